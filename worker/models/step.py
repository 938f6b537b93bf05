"""The input of one model step: a flattened, variable-length batch of sequences."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepInput:
    """New tokens of B sequences, concatenated (no padding).

    Sequence i owns ``input_ids[sum(new_lens[:i]) : sum(new_lens[:i + 1])]``; its KV lives in
    slot ``slots[i]``, which already holds ``cached_lens[i]`` tokens. After the model runs, the
    slot holds ``cached_lens[i] + new_lens[i]`` tokens.
    """

    input_ids: torch.Tensor  # [T] int64: the new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64: absolute positions
    slots: list[int]  # [B] KV slot of each sequence
    cached_lens: list[int]  # [B] tokens already in the KV of each sequence
    new_lens: list[int]  # [B] new tokens of each sequence; sum == T
    # the step's sampling applies a grammar mask: a decode step launched ahead
    # (worker/device/graphed_lm.py) waits for the sampled ids (`launch_ahead` on the logits)
    grammar_masked: bool = False
    # False when the engine knows the next step's rows differ from these (a decoder takes its
    # last token here, a prefill row finishes its prompt): a decode step launched ahead would be
    # dropped, so none is launched (worker/device/graphed_lm.py)
    same_rows_next: bool = True

    @staticmethod
    def single(
        input_ids: list[int], slot: int, cached_len: int, device: torch.device | str = "cpu"
    ) -> StepInput:
        """One sequence continuing at ``cached_len`` (a convenience for tests and tools)."""
        n = len(input_ids)
        return StepInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.arange(cached_len, cached_len + n, dtype=torch.int64, device=device),
            slots=[slot],
            cached_lens=[cached_len],
            new_lens=[n],
        )
