"""One benchmarked model: the dense model (real SmolLM2 weights when they load, else random weights of the
shape), a weight-sharing clone that carries the WIDE routers, and the calibration tokens."""
from __future__ import annotations

import torch

from . import models as MD
from .attention import wide_attention
from .router_sets import RouterSets
from .run_state import log
from .text import text_ids


class BenchModel:
    def __init__(self, run, name: str):
        self.run, self.name = run, name
        o = run.options
        self.weights = "random"
        self.tok = None
        dev, dt = run.device, run.dtype
        if name == "smollm2-135m" and o.smollm2_weights != "random":
            try:
                self.dense, self.tok = MD.load_smollm2_real(dev, dt, o.smollm2_gguf)
                self.weights = "pretrained"
                if o.layers:
                    log("  (--layers is ignored for the real SmolLM2)")
            except Exception as e:  # noqa: BLE001  the shape with random weights still times the kernels
                run.skip(f"{name}: real weights unavailable ({type(e).__name__}: {str(e)[:300]}); "
                         "using the SmolLM2 shape with random weights; 'trained' masks skipped")
        if self.weights == "random":
            positions = max(16384, max(o.decode_ctx + o.prefill_tokens) + 8)
            self.dense = MD.build_model(MD.make_config(name, layers=o.layers, max_positions=positions), dev, dt,
                                        seed=o.seed)
        self.config = self.dense.config
        self.layers = self.config.num_hidden_layers
        self.vocab = self.config.vocab_size
        self.dense_bytes = MD.param_bytes(self.dense)
        self.wide_model = MD.shared_clone(self.dense, wide_attention(self.dense.config._attn_implementation))
        self.lora: str | None = None  # the LoRA merged into wide_model's weights (None: it shares the dense ones)
        self.calib_ids = self.ids(o.calib_tokens, 1, torch.Generator().manual_seed(o.seed + 7))  # [1, calib]
        self.routers = RouterSets(self)
        c = self.config
        log(f"== {name}: {self.layers} layers, hidden {c.hidden_size}, FFN {c.intermediate_size}, "
            f"{c.num_attention_heads}/{c.num_key_value_heads} heads, weights={self.weights}, "
            f"{self.dense_bytes / 2**30:.2f} GiB")

    def use_lora(self, path: str | None) -> None:
        """wide_model's weights become the dense model's with the LoRA at `path` merged (peft, on a copy of the
        dense model), as the shipped routers run in the product (their stage-2 LoRA merged, as the demo does);
        None: the dense model's own tensors again. The dense model is never changed."""
        if path == self.lora:
            return
        import copy

        from wide_compile.training.stage2 import load_lora_merged

        dense = dict(self.dense.named_parameters())
        merged = {} if path is None else dict(load_lora_merged(copy.deepcopy(self.dense), path).named_parameters())
        modules = dict(self.wide_model.named_modules())
        for name, p in dense.items():
            owner, _, leaf = name.rpartition(".")
            q = merged.get(name)
            keep = q is None or torch.equal(q, p)
            modules[owner]._parameters[leaf] = p if keep else torch.nn.Parameter(q.detach(), requires_grad=False)
        self.lora = path
        log(f"  WIDE model weights: {'the dense ones' if path is None else 'LoRA merged from ' + str(path)}")

    def text_ids(self, tok, n: int, batch: int = 1) -> torch.Tensor:
        return text_ids(tok, n, batch, text_file=self.run.text_file, log=log)

    def ids(self, n: int, batch: int, gen: torch.Generator) -> torch.Tensor:
        """[batch, n] input ids on the device: real text for the real model, else random ids from `gen`."""
        if self.tok is not None:
            return self.text_ids(self.tok, n, batch).to(self.run.device)
        return torch.randint(0, self.vocab, (batch, n), generator=gen).to(self.run.device)

    def mask_types(self) -> list[str]:
        """--masks, with 'trained' added on the real SmolLM2 (unless --no-trained-masks) and dropped elsewhere."""
        o = self.run.options
        kinds = list(o.masks)
        if self.weights == "pretrained" and "trained" not in kinds and not o.no_trained_masks:
            kinds.append("trained")
        if self.weights != "pretrained" and "trained" in kinds:
            kinds.remove("trained")
        return kinds
