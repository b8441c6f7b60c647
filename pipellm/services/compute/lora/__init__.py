"""LoRA adapters served over the base model's weights, never merged into them.

    weights.py   a PEFT directory's A and B, fused as the decoder fuses its projections
    attach.py    wrapping a LlamaModel's projections, adapter by adapter

with the types of the floors below (tests/test_layers.py): model/linear/lora.py's LoraLinear
(a base projection of any format plus each adapter's delta on its rows) and
core/lora_groups.py's LoraGroups (a step's rows grouped by adapter).

Invariant: a row's output is base(x) + x @ A^T @ B^T * scaling of its own adapter (nothing for
a base row), in the activation dtype, whatever else the step holds.
"""
