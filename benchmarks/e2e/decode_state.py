"""Decode inputs: a static KV cache filled to `ctx` positions and the fixed inputs of one decode step.

The cache is filled by an eager dense prefill (real K/V); before every timed step `reset()` rewinds its
write position outside the timed region, so every step attends over exactly ctx + 1 keys. It follows the
transformers API of the installed version (the StaticCache arguments, the cache keyword, whether the
layers keep their own length or the caller passes cache_position).
"""
from __future__ import annotations

import inspect

import torch


class DecodeState:
    """A static KV cache filled to `ctx` positions + the fixed inputs of one decode step."""

    def __init__(self, model, batch: int, ctx: int, vocab: int, device, gen_seed: int = 0):
        from transformers import StaticCache

        sig = inspect.signature(StaticCache.__init__).parameters
        kw = {"config": model.config, "max_cache_len": ctx + 1}
        for k, v in (("max_batch_size", batch), ("batch_size", batch), ("device", device),
                     ("dtype", next(model.parameters()).dtype)):
            if k in sig:
                kw[k] = v
        self.cache = StaticCache(**kw)
        fwd = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in fwd else "past_key_values"
        g = torch.Generator(device="cpu").manual_seed(gen_seed)
        ctx_ids = torch.randint(0, vocab, (batch, ctx), generator=g).to(device)
        self.tok = torch.randint(0, vocab, (batch, 1), generator=g).to(device)
        self.pos = torch.full((batch, 1), ctx, dtype=torch.long, device=device)
        self.ctx = ctx
        with torch.no_grad():  # fill the cache with real K/V (eager dense prefill)
            model(input_ids=ctx_ids, use_cache=True, logits_to_keep=1,
                  **{self.cache_kw: self.cache}, **self._pos_kwargs(torch.arange(ctx, device=device)))
        self.counters = [t for t in (getattr(layer, "cumulative_length", None)
                                     for layer in getattr(self.cache, "layers", []))
                         if isinstance(t, torch.Tensor)]
        self.use_cache_position = not self.counters  # older transformers: positions passed explicitly
        self.cache_position = torch.tensor([ctx], device=device)
        self.reset()

    def _pos_kwargs(self, cp):
        from transformers import cache_utils

        layer_cls = getattr(cache_utils, "StaticLayer", None)
        new_api = layer_cls is not None and "cumulative_length" in inspect.getsource(layer_cls)
        return {} if new_api else {"cache_position": cp}

    def reset(self):
        for t in self.counters:
            t.fill_(self.ctx)

    def nbytes(self) -> int:
        n = 0
        for layer in getattr(self.cache, "layers", []):
            for a in ("keys", "values"):
                t = getattr(layer, a, None)
                if isinstance(t, torch.Tensor):
                    n += t.numel() * t.element_size()
        return n

    def step_fn(self, m):
        kw = {self.cache_kw: self.cache}
        if self.use_cache_position:
            kw["cache_position"] = self.cache_position

        def step():
            return m(input_ids=self.tok, position_ids=self.pos, use_cache=True, **kw)

        return step
