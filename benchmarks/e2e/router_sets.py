"""The routers of a row, by capacity and mask kind (e2e/masks.py builds them), made once per model and
reused across its workloads; each records the capacity it gives on the calibration tokens."""
from __future__ import annotations

from . import masks as M
from .options import structured_kind
from .run_state import log


class RouterSets:
    def __init__(self, bm):
        self.bm = bm
        self.cache: dict = {}
        self.mask_model: dict | None = None  # the correlated masks' fitted model, once fitted
        self.trained_sets: dict = {}  # capacity -> the name of the shipped set trained() chose

    def cfg(self, cap: float):
        o = self.bm.run.options
        ffn, head = o.group_sizes(self.bm.name)
        return M.make_cfg(cap, ffn, head, o.router_recipe(self.bm.name))

    def correlated_model(self) -> dict:
        """Fit the correlated masks' rho to the trained routers' statistics (or the stored defaults)."""
        if self.mask_model is not None:
            return self.mask_model
        run, o = self.bm.run, self.bm.run.options
        stats = None
        if not o.no_trained_stats:
            if run.trained_stats is None:
                run.trained_stats = M.trained_router_stats(run.device, run.dtype, self.bm.text_ids, log=log,
                                                           gguf=o.smollm2_gguf) or {}
            stats = run.trained_stats
        stats = stats or M.default_stats()
        rho, tried = M.fit_rho(self.bm.wide_model, self.cfg, self.bm.calib_ids, 0.5, stats, seed=o.seed, log=log,
                               grid=(0.0, 0.9) if o.smoke else M.RHO_GRID)
        self.mask_model = {"stats_target": {k: v for k, v in stats.items() if k != "all"}, "rho": rho,
                           "rank": M.LATENT_RANK, "fit": tried}
        log(f"  correlated mask model: {self.mask_model['stats_target']} -> rho={rho}")
        return self.mask_model

    def trained(self, cap: float):
        """The shipped SmolLM2 routers closest to `cap` (within 0.05)."""
        if self.bm.weights != "pretrained":
            raise RuntimeError("trained routers need the real SmolLM2 weights")
        names = [n for n in M.Routers.available() if "smollm" in n.lower()]
        cands = []
        for n in names:
            try:
                rr = M.Routers.pretrained(n, self.bm.wide_model)
                cands.append((abs(rr.cfg.capacity - cap), n, rr))
            except Exception as e:  # noqa: BLE001  one unloadable set does not stop the others
                log(f"  trained routers {n}: {e}")
        cands = [c for c in cands if c[0] <= 0.05]
        if not cands:
            raise RuntimeError(f"no trained SmolLM2 routers with capacity ~{cap} (available: {names or 'none'})")
        _, name, routers = min(cands, key=lambda c: c[0])
        self.trained_sets[round(cap, 4)] = name
        return routers

    def lora(self, cap: float, masks: str) -> str | None:
        """The LoRA that goes with a row's routers (after get() built them): the shipped set's stage-2 LoRA for
        trained routers (unless --no-lora), else None (the dense weights)."""
        if masks != "trained" or self.bm.run.options.no_lora:
            return None
        from wide_compile.pretrained import lora_path

        path = lora_path(self.trained_sets[round(cap, 4)])
        return None if path is None else str(path)

    def build(self, cap: float, masks: str):
        bm, seed = self.bm, self.bm.run.options.seed
        if cap >= 0.9999:
            return M.all_on_routers(bm.wide_model, self.cfg(1.0), seed=seed)
        if masks == "random":
            return M.random_routers(bm.wide_model, self.cfg(cap), bm.calib_ids, cap, seed=seed)
        if masks == "correlated":
            mm = self.correlated_model()
            return M.correlated_routers(bm.wide_model, self.cfg(cap), bm.calib_ids, cap, mm["rho"],
                                        mm["stats_target"], seed=seed)
        if masks == "trained":
            return self.trained(cap)
        structured = structured_kind(masks)
        if structured is not None:
            return M.structured_routers(bm.wide_model, self.cfg(cap), bm.calib_ids, cap, *structured, seed=seed)
        raise ValueError(f"mask kind {masks!r}: expected random, correlated, trained, codebookP or nestedL")

    def get(self, cap: float, masks: str):
        key = (round(cap, 4), masks)
        if key not in self.cache:
            self.bm.use_lora(None)  # random and correlated routers are fitted on the dense weights
            r = self.build(cap, masks)
            self.bm.use_lora(self.lora(cap, masks))  # measured on the weights the row runs them on
            self._calibration_capacity(r)
            self.cache[key] = r
        return self.cache[key]

    def _calibration_capacity(self, r) -> None:
        """r.calib_capacity: the capacity on the calibration tokens (a decode row's own is one token's)."""
        import torch
        import wide_compile as wc

        wm = self.bm.wide_model
        try:
            wc.attach(wm, r)
            try:
                with torch.no_grad():
                    r.calib_capacity = round(wc.measure_capacity(wm, self.bm.calib_ids)["overall"], 4)
            finally:
                wc.detach(wm)
        except Exception as e:  # noqa: BLE001  the record then has no calibrated_capacity
            log(f"    measure_capacity on calibration tokens failed: {type(e).__name__}: {e}")
