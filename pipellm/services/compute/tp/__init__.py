"""Tensor parallelism (`--tensor-parallel-size N`): one model split across N ranks, Megatron-style.

    group.py   the ranks: rank 0 (the engine's process) spawns 1..N-1 and they join one
               torch.distributed group (gloo on CPU)
    step.py    what rank 0 broadcasts each step (StepInputs: KV moves and the ForwardBatch;
               or a pooling forward's batch and pooled rows, no LM head)
    shard.py   which slice of each weight a rank holds (with --enable-expert-parallel, whole
               experts: a contiguous block of them), and of each LoRA adapter's factors; the
               shapes N must divide
    layers.py  the layers that cross ranks: row-parallel o/down, vocab-parallel embedding,
               the LM head gathered on rank 0, OLMoE's q/k norms over all ranks' heads
    quantized.py  W8A8 and FP8: o and down quantized with the whole rows' scales (MAX
               all-reduces), SmoothQuant calibrated on the ranks' float model
    model.py   a rank's decoder (LlamaModel over its shard)
The processes, on compute's top floor beside service.py: ../tp_worker.py (ranks 1..N-1:
join, build, run each broadcast step's forward) and ../tp_node.py (another machine's ranks,
--nnodes M --node-rank K: started again per group).

With N = 1 none of this is imported (pipellm/services/compute/runner.py).
"""
