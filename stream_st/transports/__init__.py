"""Bytes in and out: one module or folder per medium (``file/``, ``http/``, ``s3/``, ``tcp``,
``hub``, in-memory and stream adapters), each holding both directions, behind the interfaces of
:mod:`.base`. :mod:`.registry` is the one place that picks a transport for a path, URL or object."""
