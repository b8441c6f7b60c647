"""The KV cache: the tensors (`kv_cache.py`), and the allocators that hand out segments of it:
contiguous segments sized by predicted length (`allocator.py`, moved by `compaction.py`) or
vLLM-style blocks (`paged_allocator.py`)."""
