"""The reference ``safetensors`` API over the streaming core: ``safe_open``, ``load_file``,
``save_file`` (:mod:`._reference`), run on a private event loop (:mod:`._sync`). The drop-ins
:mod:`stream_st.torch` and :mod:`stream_st.numpy` are built on it."""
