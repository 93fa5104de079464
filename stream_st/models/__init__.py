"""Models the demos and benchmarks run: MiniLM's BERT (:mod:`.bert`) and a Llama-family decoder
(:mod:`.llm`). Uses of the library, never imported by it."""
