"""The pooling runner's tasks on an LLMEngine: embed, classify (a scoring head) and reward (a
reward head per token), each over whole token-id prompts, with the model's heads and pooling
read or built once, the first time a task needs them."""

from __future__ import annotations

import functools
from dataclasses import replace

from pipellm.services.compute.pooling.embedder import embed
from pipellm.services.compute.pooling.reward import RewardHead, reward
from pipellm.services.compute.pooling.scoring import ScoringHead, classify
from pipellm.shared.pooling import PoolingConfig
from pipellm.shared.scoring import ScoringConfig


class PoolingTasks:
    """LLMEngine's pooling methods (a mixin over its `config`, `runner` and `model_config`)."""

    @functools.cached_property
    def pooling(self) -> PoolingConfig:
        """How `embed` pools: the model's (pipellm/shared/pooling.py), read once."""
        return PoolingConfig.resolve(self.config.model, self.config.pooler_config)

    def embed(self, prompts: list[list[int]], dimensions: int | None = None,
              normalize: bool | None = None):
        """[N, dim] float32 pooled embeddings of whole prompts (embedder.py), L2-normalized as
        `normalize` says (None: as the model's pooling config does)."""
        pooling = self.pooling if normalize is None else replace(self.pooling,
                                                                  normalize=normalize)
        return embed(self, prompts, pooling, dimensions)

    @functools.cached_property
    def scoring(self) -> ScoringHead:
        """The model's scoring head (pipellm/shared/scoring.py says which), built once."""
        config = ScoringConfig.from_dir(self.config.model, self.config.hf_overrides,
                                        self.config.convert)
        return ScoringHead(self.runner.model, config, self.model_config.final_softcap)

    def classify(self, prompts: list[list[int]]):
        """[N, k] float32 logits of the scoring head over whole prompts' last tokens (k: the
        labels; 1 for a yes/no reranker: logit[yes] - logit[no])."""
        return classify(self, prompts, self.scoring)

    @functools.cached_property
    def reward_head(self) -> RewardHead:
        """A reward model's per-token head (reward.py), built once."""
        return RewardHead(self.runner.model)

    def reward(self, prompts: list[list[int]]):
        """[total tokens, k] float32: every token's reward head output (reward.py)."""
        return reward(self, prompts, self.reward_head)
