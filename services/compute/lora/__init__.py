"""LoRA adapters served over the base model's weights, never merged into them.

    weights.py   a PEFT directory's A and B, fused as the decoder fuses its projections
    linear.py    LoraLinear: a base projection (any format) plus each adapter's delta on its rows
    groups.py    LoraGroups: a step's rows grouped by adapter
    attach.py    wrapping a LlamaModel's projections, adapter by adapter

Invariant: a row's output is base(x) + x @ A^T @ B^T * scaling of its own adapter (nothing for
a base row), in the activation dtype, whatever else the step holds.
"""
