"""pipellm: an LLM inference server whose tokenizer, compute and detokenizer run as separate
processes over ZeroMQ, with Redis holding request state (docs/architecture.md).

    services/  the processes: gateway, tokenizer, compute, detokenizer, and the CLI that starts them
    shared/    what two services need: typed messages and their codec, configs, the model's facts
    kernels/   the memory-bound ops: Triton, C++ for CPUs, and their PyTorch references
    loadgen/   the load generator (pipellm-bench)
"""
