"""Turn logits rows into tokens, one row per sampling request.

Greedy rows take the argmax. Random rows apply temperature, then top-k, then top-p, and draw;
a seeded request's draw for its n-th output token comes from a generator seeded with (seed, n)
alone, so it gets the same tokens whatever else shares its batch and however often its steps
were retried (a failed step's draws are not replayed: docs/design.md section 4.1). min_tokens is
enforced by masking EOS and stop token ids.
"""

from __future__ import annotations

import torch

from engine.interfaces.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._default_generator = torch.Generator(device=self.device)
        self._default_generator.manual_seed(seed)
        self._seeded_generator = torch.Generator(device=self.device)  # reseeded for each draw

    def sample(
        self,
        logits: torch.Tensor,  # (n, V) fp32
        params: list[SamplingParams],
        num_output_tokens: list[int],
        argmax: torch.Tensor | None = None,  # (n,) int64, torch.argmax(logits, -1) computed already
    ) -> torch.Tensor:
        """(n,) int64 on the logits' device, one token per row, with no wait for the device
        (the worker reads the tokens back later). `logits` is masked in place for min_tokens.
        `argmax` (the decode graphs compute it after their LM head) stands in for the greedy
        rows' argmax unless a row's min_tokens masking changed the logits; it is not written."""
        for row, (sampling, generated) in enumerate(zip(params, num_output_tokens)):
            if generated < sampling.min_tokens:
                banned = list(sampling.stop_token_ids)
                if not sampling.ignore_eos:
                    banned += list(sampling.eos_token_ids)
                if banned:
                    logits[row, banned] = float("-inf")
                    argmax = None

        tokens = torch.argmax(logits, dim=-1) if argmax is None else argmax
        drawn = [row for row, sampling in enumerate(params) if not sampling.greedy]
        if drawn:
            tokens = tokens.clone()
            for row in drawn:
                generator = self._generator_for(params[row], num_output_tokens[row])
                tokens[row] = sample_row(logits[row], params[row], generator)
        return tokens

    def _generator_for(self, sampling: SamplingParams, num_output_tokens: int) -> torch.Generator:
        """The shared generator for unseeded requests; for a seeded one, a generator seeded
        with a mix of the seed and the index of the token it draws."""
        if sampling.seed is None:
            return self._default_generator
        mixed = (sampling.seed + (num_output_tokens + 1) * 0x9E3779B97F4A7C15) % 2**64
        return self._seeded_generator.manual_seed(mixed)


def sample_row(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Draw one token from a (V,) logits row with temperature, top-k and top-p: a 0-d int64
    tensor on the row's device."""
    scaled = logits / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth_value = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth_value, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        dropped = mass_before >= sampling.top_p
        dropped[0] = False  # also when top_p is 0 in the logits' dtype (below ~1e-45 in fp32)
        sorted_probs = sorted_probs.masked_fill(dropped, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[0]
