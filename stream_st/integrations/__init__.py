"""Integrations with other engines, built on the public readers and writers: the dataset layout
shared with the Spark data source (:mod:`.dataset`) and a torch ``IterableDataset``
(:mod:`.torch_dataset`). The Spark data source itself is the package ``pyspark_safetensors``."""
