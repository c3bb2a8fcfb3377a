"""``python -m prims_ts check``: every public API on random problems vs. the float64 reference.

The registry holds one list of :class:`CheckCase` per API. A case builds its
inputs on the requested device (small sizes on the CPU, where the ops run the
reference itself), calls the public function with an ``out`` tensor poisoned
with NaN, and returns ``(out, ref)``; the driver measures
``‖out − ref‖ / ‖ref‖`` against the dtype's tolerance (DESIGN.md, Testing).

A new API adds rows with ``register("api_name", [CheckCase(...), ...])`` at the
bottom of this module; the driver (:func:`run_checks`) does not change.
"""
from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .testing import TOLERANCE, relative_error


# (device, small) -> (out, ref); small=True on the CPU.
CaseFn = Callable[[torch.device, bool], Tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class CheckCase:
    api: str
    name: str  # short and unique within the API, e.g. "fixed causal+window D128 GQA4"
    dtype: torch.dtype  # input dtype: sets the tolerance
    run: CaseFn
    describe: Callable[[bool], str] = field(default=lambda small: "")  # shapes, for the table


REGISTRY: Dict[str, List[CheckCase]] = {}


def register(api: str, cases: Sequence[CheckCase]) -> None:
    REGISTRY.setdefault(api, []).extend(cases)


@dataclass
class CheckResult:
    case: CheckCase
    shape: str
    rel_err: Optional[float]
    tol: float
    ok: bool
    seconds: float
    error: str = ""


def _dt(d: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(d, str(d))


def run_case(case: CheckCase, device: torch.device, small: bool) -> CheckResult:
    tol = TOLERANCE[case.dtype]
    shape = case.describe(small)
    t0 = time.perf_counter()
    try:
        out, ref = case.run(device, small)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        err = relative_error(out, ref)
        ok = not math.isnan(err) and err <= tol
        return CheckResult(case, shape, err, tol, ok, time.perf_counter() - t0,
                           "" if not math.isnan(err) else "NaN/Inf in output")
    except Exception as e:  # a failing case is a FAIL row, never an abort
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        return CheckResult(case, shape, None, tol, False, time.perf_counter() - t0, msg)


def select(apis: Optional[Sequence[str]] = None, match: Optional[str] = None) -> List[CheckCase]:
    cases = []
    for api, rows in REGISTRY.items():
        if apis and api not in apis:
            continue
        for c in rows:
            if match and match.lower() not in f"{api} {c.name}".lower():
                continue
            cases.append(c)
    return cases


def run_checks(device: torch.device, apis: Optional[Sequence[str]] = None, match: Optional[str] = None,
               verbose: bool = False, printer=print) -> List[CheckResult]:
    """Runs the selected cases on ``device`` and prints a pass/fail table; returns the results."""
    small = device.type != "cuda"
    cases = select(apis, match)
    printer(f"prims_ts check on {device}{' (small sizes, CPU reference kernels)' if small else ''}: "
            f"{len(cases)} cases; tolerance ‖out-ref‖/‖ref‖ <= 2e-2 bf16, 5e-3 fp16; out poisoned with NaN")
    w_api = max([len("api")] + [len(c.api) for c in cases])
    w_name = max([len("case")] + [len(c.name) for c in cases])
    shapes = [c.describe(small) for c in cases]
    w_shape = max([len("shape")] + [len(s) for s in shapes])
    header = (f"{'api':<{w_api}}  {'case':<{w_name}}  {'dtype':<5}  {'shape':<{w_shape}}  "
              f"{'rel err':>9}  {'tol':>7}  {'time':>6}  result")
    printer(header)
    printer("-" * len(header))
    results = []
    for case in cases:
        r = run_case(case, device, small)
        results.append(r)
        err = "-" if r.rel_err is None else ("nan" if math.isnan(r.rel_err) else f"{r.rel_err:.2e}")
        line = (f"{case.api:<{w_api}}  {case.name:<{w_name}}  {_dt(case.dtype):<5}  {r.shape:<{w_shape}}  "
                f"{err:>9}  {r.tol:>7.0e}  {r.seconds:>5.2f}s  {'PASS' if r.ok else 'FAIL'}")
        if r.error:
            line += f"  {r.error}"
        printer(line)
        if verbose and not r.ok and r.error:
            traceback.print_exc()
    n_fail = sum(not r.ok for r in results)
    printer("-" * len(header))
    printer(f"{len(results) - n_fail} passed, {n_fail} failed")
    return results


# ----------------------------------------------------------------------------
# Shared helpers for cases
# ----------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _randn(shape, dtype, device, g) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)


def _poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)


def _seed(name: str) -> int:
    return sum((i + 1) * ord(ch) for i, ch in enumerate(name)) % (2 ** 31)


# ----------------------------------------------------------------------------
# batch_prefill (SPEC §1)
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillSpec:
    layout: str  # "fixed" | "packed"
    mask: str  # "dense" | "causal" | "variable_window"
    head_dim: int
    hq: int
    hkv: int
    dtype: torch.dtype
    window_left: int = -1  # GPU value; scaled down on the CPU
    sq_lt_sk: bool = False  # fixed only: Sq < Sk (bottom-right causal alignment)
    out_dtype: Optional[torch.dtype] = None

    def sizes(self, small: bool):
        """fixed: (B, Sq, Sk); packed: (q_lens, kv_lens). Tails on purpose (not tile multiples)."""
        if self.layout == "fixed":
            if small:
                return (2, 29, 53) if self.sq_lt_sk else (2, 40, 40)
            return (2, 200, 333) if self.sq_lt_sk else (2, 300, 300)
        if small:
            return [1, 17, 40], [1, 29, 40]
        return [1, 130, 300, 77], [1, 190, 300, 500]

    def window(self, small: bool) -> int:
        if self.window_left < 0:
            return -1
        return max(1, self.window_left // 8) if small else self.window_left

    def name(self) -> str:
        mask = self.mask
        if self.window_left >= 0:
            mask += "+window"
        group = self.hq // self.hkv
        heads = "MHA" if group == 1 else ("MQA" if self.hkv == 1 else f"GQA{group}")
        extra = " Sq<Sk" if self.sq_lt_sk else ""
        extra += f" out={_dt(self.out_dtype)}" if self.out_dtype is not None else ""
        return f"{self.layout} {mask} D{self.head_dim} {heads}{extra}"

    def describe(self, small: bool) -> str:
        sz = self.sizes(small)
        heads = f"H{self.hq}/{self.hkv} D{self.head_dim}"
        w = self.window(small)
        win = f" W{w}" if w >= 0 else ""
        if self.layout == "fixed":
            b, sq, sk = sz
            return f"B{b} Sq{sq} Sk{sk} {heads}{win}"
        ql, kl = sz
        lens = lambda xs: "[" + ",".join(map(str, xs)) + "]"  # noqa: E731
        return f"q{lens(ql)} kv{lens(kl)} {heads}{win}"

    def run(self, device: torch.device, small: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        import prims_ts
        from prims_ts import reference

        g = _gen(_seed(self.name()))
        d, dt = self.head_dim, self.dtype
        w = self.window(small)
        kwargs = dict(mask_type=self.mask, window_left=w)
        ref_kwargs = dict(mask_type=self.mask, window_left=w)
        if self.layout == "fixed":
            b, sq, sk = self.sizes(small)
            q = _randn((b, sq, self.hq, d), dt, device, g)
            k = _randn((b, sk, self.hkv, d), dt, device, g)
            v = _randn((b, sk, self.hkv, d), dt, device, g)
            if self.mask == "variable_window":
                lo = torch.randint(0, sk, (b, sq), generator=g)
                hi = torch.randint(0, sk, (b, sq), generator=g)
                starts = torch.minimum(lo, hi).to(torch.int32).to(device)
                ends = torch.maximum(lo, hi).to(torch.int32).to(device)
                kwargs.update(variable_window_token_starts=starts, variable_window_token_ends=ends)
                ref_kwargs.update(window_starts=starts, window_ends=ends)
        else:
            q_lens, kv_lens = self.sizes(small)
            qo = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
            kvo = torch.tensor([0] + kv_lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
            q = _randn((sum(q_lens), self.hq, d), dt, device, g)
            k = _randn((sum(kv_lens), self.hkv, d), dt, device, g)
            v = _randn((sum(kv_lens), self.hkv, d), dt, device, g)
            kwargs.update(qo_indptr=qo, kv_indptr=kvo)
            ref_kwargs.update(qo_indptr=qo, kv_indptr=kvo)
        out = _poisoned(q.shape, self.out_dtype or dt, device)
        res = prims_ts.batch_prefill(q, k, v, out=out, **kwargs)
        if res is not out:
            raise AssertionError("batch_prefill(out=...) must return out itself")
        ref = reference.batch_prefill(q, k, v, compute_dtype=torch.float64, **ref_kwargs)
        return out, ref

    def case(self) -> CheckCase:
        return CheckCase("batch_prefill", self.name(), self.dtype, self.run, self.describe)


def _prefill_cases() -> List[CheckCase]:
    bf16, fp16 = torch.bfloat16, torch.float16
    specs = []
    for dt in (bf16, fp16):
        specs += [
            PrefillSpec("fixed", "dense", 128, 8, 2, dt),
            PrefillSpec("fixed", "causal", 128, 8, 2, dt),
            PrefillSpec("fixed", "causal", 128, 8, 1, dt, sq_lt_sk=True),
            PrefillSpec("fixed", "causal", 128, 8, 2, dt, window_left=100),
            PrefillSpec("fixed", "variable_window", 128, 8, 2, dt),
            PrefillSpec("fixed", "dense", 256, 4, 2, dt),
            PrefillSpec("fixed", "causal", 256, 4, 4, dt),
            PrefillSpec("fixed", "variable_window", 256, 4, 2, dt),
            PrefillSpec("packed", "dense", 128, 8, 2, dt),
            PrefillSpec("packed", "causal", 128, 8, 2, dt),
            PrefillSpec("packed", "causal", 256, 4, 1, dt, window_left=64),
        ]
    specs.append(PrefillSpec("fixed", "causal", 128, 8, 2, bf16, out_dtype=torch.float32))
    return [s.case() for s in specs]


register("batch_prefill", _prefill_cases())


# ----------------------------------------------------------------------------
# batch_prefill_with_paged_kv_cache (SPEC §2)
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PagedPrefillSpec:
    page_size: int
    mask: str  # "dense" | "causal"
    head_dim: int
    hq: int
    hkv: int
    dtype: torch.dtype
    window_left: int = -1

    def sizes(self, small: bool):
        """(q_lens, kv_lens): lengths that are not page multiples, Sq <= Sk."""
        if small:
            return [1, 17, 30], [5, 40, 30]
        return [1, 130, 300, 77], [17, 190, 300, 1030]

    def name(self) -> str:
        mask = self.mask + ("+window" if self.window_left >= 0 else "")
        return f"page{self.page_size} {mask} D{self.head_dim} H{self.hq}/{self.hkv}"

    def describe(self, small: bool) -> str:
        ql, kl = self.sizes(small)
        return f"q{ql} kv{kl} ps{self.page_size}".replace(" ", "")

    def run(self, device: torch.device, small: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        import prims_ts
        from prims_ts import reference

        g = _gen(_seed(self.name()))
        ps, d, dt = self.page_size, self.head_dim, self.dtype
        q_lens, kv_lens = self.sizes(small)
        need = [(n + ps - 1) // ps for n in kv_lens]
        cols = max(need) + 2  # padding columns at the end of every row
        pool = sum(need) + 3
        # non-identity page order; the table is a row-strided view of a wider one
        perm = torch.randperm(pool, generator=g).to(torch.int32)
        wide = torch.full((len(q_lens), cols + 5), -1, dtype=torch.int32)
        at = 0
        for b, n in enumerate(need):
            wide[b, :n] = perm[at:at + n]
            at += n
        table = wide.to(device)[:, :cols]
        kc = _randn((pool, self.hkv, ps, d), dt, device, g)
        vc = _randn((pool, self.hkv, ps, d), dt, device, g)
        qo = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
        lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
        q = _randn((sum(q_lens), self.hq, d), dt, device, g)
        out = _poisoned(q.shape, dt, device)
        w = self.window_left if not small or self.window_left < 0 else max(1, self.window_left // 8)
        prims_ts.batch_prefill_with_paged_kv_cache(q, kc, vc, qo, table, lens, page_size=ps, mask_type=self.mask,
                                                   window_left=w, out=out)
        ref = reference.batch_prefill_paged(q, kc, vc, qo, table, lens, mask_type=self.mask, window_left=w,
                                            compute_dtype=torch.float64)
        return out, ref

    def case(self) -> CheckCase:
        return CheckCase("batch_prefill_with_paged_kv_cache", self.name(), self.dtype, self.run, self.describe)


def _paged_prefill_cases() -> List[CheckCase]:
    bf16, fp16 = torch.bfloat16, torch.float16
    specs = [
        PagedPrefillSpec(16, "causal", 128, 8, 2, bf16),
        PagedPrefillSpec(32, "dense", 128, 8, 2, bf16),
        PagedPrefillSpec(64, "causal", 256, 4, 1, bf16, window_left=64),
        PagedPrefillSpec(128, "causal", 128, 8, 8, fp16),
        PagedPrefillSpec(16, "dense", 256, 4, 2, fp16),
    ]
    return [s.case() for s in specs]


register("batch_prefill_with_paged_kv_cache", _paged_prefill_cases())


# ----------------------------------------------------------------------------
# prims_ts_batch_decode_with_kv_cache (SPEC §3)
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeSpec:
    q_mode: str  # "single" [B,Hq,D] | "multi" [B,SQ,Hq,D] | "packed" [T,Hq,D]
    mask: str
    head_dim: int
    hq: int
    hkv: int
    page_size: int
    combined: bool
    dtype: torch.dtype
    window_left: int = -1

    def q_lens(self, small: bool):
        n = 3 if small else 4
        return {"single": [1] * n, "multi": [3] * n, "packed": [1, 3, 4, 2][:n]}[self.q_mode]

    def lens(self, small: bool):
        """K/V lengths: 1 and not page multiples, never below the request's query count."""
        base = [1, 37, 100] if small else [1, 37, 1000, 5000]
        return [max(n, q) for n, q in zip(base, self.q_lens(small))]

    def name(self) -> str:
        mask = self.mask + ("+window" if self.window_left >= 0 else "")
        return (f"{self.q_mode} {mask} D{self.head_dim} H{self.hq}/{self.hkv} page{self.page_size} "
                f"{'combined' if self.combined else 'tuple'}")

    def describe(self, small: bool) -> str:
        return f"lens{self.lens(small)}".replace(" ", "")

    def run(self, device: torch.device, small: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        import prims_ts
        from prims_ts import reference

        g = _gen(_seed(self.name()))
        ps, d, dt = self.page_size, self.head_dim, self.dtype
        lens, qlens = self.lens(small), self.q_lens(small)
        need = [(n + ps - 1) // ps for n in lens]
        pool = sum(need) + 2
        indices = torch.randperm(pool, generator=g)[: sum(need)].to(torch.int32).to(device)
        indptr = torch.tensor([0] + need, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        k = _randn((pool, self.hkv, ps, d), dt, device, g)
        v = _randn((pool, self.hkv, ps, d), dt, device, g)
        cache = torch.stack([k, v], dim=1) if self.combined else (k, v)
        b = len(lens)
        kwargs = dict(mask_type=self.mask, window_left=self.window_left)
        if self.q_mode == "single":
            q = _randn((b, self.hq, d), dt, device, g)
            max_sq = 1
        elif self.q_mode == "multi":
            q = _randn((b, 3, self.hq, d), dt, device, g)
            kwargs["seq_len_q"] = max_sq = 3
        else:
            qo = torch.tensor([0] + qlens, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
            q = _randn((sum(qlens), self.hq, d), dt, device, g)
            max_sq = max(qlens)
            kwargs.update(qo_indptr=qo, max_seq_len_q=max_sq)
        ws = torch.zeros(prims_ts.get_prims_ts_batch_decode_workspace_size(
            b, self.hq, self.hkv, d, ps, max(lens), seq_len_q=kwargs.get("seq_len_q", 1),
            qo_indptr=kwargs.get("qo_indptr"), max_seq_len_q=max_sq, device=device), dtype=torch.uint8, device=device)
        out = _poisoned(q.shape, dt, device)
        prims_ts.prims_ts_batch_decode_with_kv_cache(q, cache, ws, indptr, indices, seq_lens, max(lens), out=out,
                                                     **kwargs)
        ref = reference.batch_decode(q, k, v, indptr, indices, seq_lens, qo_indptr=kwargs.get("qo_indptr"),
                                     mask_type=self.mask, window_left=self.window_left,
                                     compute_dtype=torch.float64)
        return out, ref

    def case(self) -> CheckCase:
        return CheckCase("prims_ts_batch_decode_with_kv_cache", self.name(), self.dtype, self.run, self.describe)


def _decode_cases() -> List[CheckCase]:
    bf16, fp16 = torch.bfloat16, torch.float16
    specs = [
        DecodeSpec("single", "dense", 128, 32, 8, 32, True, bf16),
        DecodeSpec("single", "dense", 64, 8, 8, 16, False, fp16),
        DecodeSpec("single", "causal", 256, 16, 8, 64, True, bf16, window_left=50),
        DecodeSpec("multi", "causal", 128, 32, 1, 128, False, bf16),
        DecodeSpec("packed", "causal", 128, 16, 4, 32, True, fp16),
        DecodeSpec("packed", "dense", 256, 8, 1, 16, False, bf16),
    ]
    return [s.case() for s in specs]


register("prims_ts_batch_decode_with_kv_cache", _decode_cases())


# ----------------------------------------------------------------------------
# MLA decode (SPEC §4): the one-shot, the standalone and the wrapper
# ----------------------------------------------------------------------------

MLA_APIS = {"oneshot": "batch_mla_decode_with_paged_kv_cache",
            "standalone": "prims_ts_batch_decode_with_kv_cache_mla",
            "wrapper": "BatchMLADecodePagedTSWrapper"}


@dataclass(frozen=True)
class MLASpec:
    entry: str  # "oneshot" | "standalone" | "wrapper" (run(validate=False))
    q_mode: str  # "fixed" [B, SQ, H, 576] | "packed" [T, H, 576]
    mask: str  # "dense" | "causal"
    heads: int
    sq: int  # fixed: SQ; packed: the largest per-request query count
    page_size: int
    rank: int  # 3: [P, ps, 576]; 4: [P, 1, ps, 576]
    dtype: torch.dtype  # sets the tolerance: fp16 cases ask for fp16 output (the default is bf16)
    out_dtype: Optional[torch.dtype] = None

    def q_lens(self, small: bool):
        n = 3 if small else 4
        if self.q_mode == "fixed":
            return [self.sq] * n
        return [1, self.sq, max(1, self.sq - 1), 2][:n]

    def lens(self, small: bool):
        """K/V lengths: 1 (or the query count) and not page multiples."""
        base = [1, 37, 100] if small else [1, 37, 1000, 5000]
        return [max(n, q) for n, q in zip(base, self.q_lens(small))]

    def name(self) -> str:
        extra = f" out={_dt(self.out_dtype)}" if self.out_dtype is not None else ""
        return (f"{self.q_mode} {self.mask} H{self.heads} SQ{self.sq} page{self.page_size} "
                f"{self.rank}-D cache{extra}")

    def describe(self, small: bool) -> str:
        return f"lens{self.lens(small)}".replace(" ", "")

    def run(self, device: torch.device, small: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        import prims_ts
        from prims_ts import reference

        g = _gen(_seed(self.entry + " " + self.name()))
        ps, dt, h = self.page_size, self.dtype, self.heads
        lens, q_lens = self.lens(small), self.q_lens(small)
        b = len(lens)
        need = [(n + ps - 1) // ps for n in lens]
        pool = sum(need) + 2
        # shuffled pages; the table is a row-strided view of a wider one, garbage past the live pages
        perm = torch.randperm(pool, generator=g).to(torch.int32)
        cols = max(need) + 1
        wide = torch.full((b, cols + 3), -1, dtype=torch.int32)
        at = 0
        for i, n in enumerate(need):
            wide[i, :n] = perm[at:at + n]
            at += n
        table = wide.to(device)[:, :cols]
        latents = _randn((pool, ps, 576), dt, device, g)
        used = torch.zeros(pool, ps, dtype=torch.bool)
        for i, n in enumerate(lens):
            j = torch.arange(n)
            used[wide[i, :need[i]].long()[j // ps], j % ps] = True
        latents.masked_fill_((~used).to(device)[:, :, None], float("nan"))  # unused slots: never read
        cache = latents.unsqueeze(1) if self.rank == 4 else latents
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        qo = None
        if self.q_mode == "fixed":
            q = _randn((b, self.sq, h, 576), dt, device, g)
        else:
            qo = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
            q = _randn((sum(q_lens), h, 576), dt, device, g)
        scale = 1.0 / math.sqrt(576)
        odt = self.out_dtype or torch.bfloat16
        out = _poisoned(tuple(q.shape[:-1]) + (512,), odt, device)
        max_sq = self.sq
        if self.entry == "oneshot":
            res = prims_ts.batch_mla_decode_with_paged_kv_cache(
                q, cache, table, seq_lens, qo_indptr=qo, mask_type=self.mask, bmm1_scale=scale, out=out,
                out_dtype=odt)
        elif self.entry == "standalone":
            ws = torch.zeros(prims_ts.get_prims_ts_batch_decode_mla_workspace_size(
                b, h, 512, 64, ps, max(lens), max_seq_len_q=max_sq, device=device), dtype=torch.uint8, device=device)
            res = prims_ts.prims_ts_batch_decode_with_kv_cache_mla(
                q, cache, ws, 512, 64, table, seq_lens, max(lens), qo_indptr=qo,
                max_seq_len_q=max_sq if qo is not None else None, mask_type=self.mask, bmm1_scale=scale, out=out,
                out_dtype=odt)
        else:
            w = prims_ts.BatchMLADecodePagedTSWrapper()
            w.plan(table, seq_lens, h, 512, 64, ps, qo_indptr=qo, max_seq_len_q=max_sq, mask_type=self.mask,
                   q_data_type=dt, o_data_type=odt)
            res = w.run(q, cache, bmm1_scale=scale, out=out, validate=False)
        if res is not out:
            raise AssertionError(f"{MLA_APIS[self.entry]}(out=...) must return out itself")
        ref = reference.batch_mla_decode(q, cache, table, seq_lens, qo_indptr=qo, mask_type=self.mask,
                                         sm_scale=scale, compute_dtype=torch.float64)
        return out, ref

    def case(self) -> CheckCase:
        return CheckCase(MLA_APIS[self.entry], self.name(), self.dtype, self.run, self.describe)


def _mla_cases() -> List[CheckCase]:
    bf16, fp16 = torch.bfloat16, torch.float16
    specs = [
        MLASpec("oneshot", "fixed", "causal", 16, 1, 64, 3, bf16),
        MLASpec("oneshot", "packed", "causal", 128, 4, 16, 4, bf16),
        MLASpec("oneshot", "fixed", "dense", 32, 2, 128, 4, fp16, out_dtype=fp16),
        MLASpec("oneshot", "packed", "dense", 8, 3, 32, 3, bf16, out_dtype=torch.float32),
        MLASpec("standalone", "fixed", "causal", 64, 1, 32, 3, bf16),
        MLASpec("standalone", "packed", "causal", 16, 4, 64, 4, fp16, out_dtype=fp16),
        MLASpec("standalone", "fixed", "causal", 128, 2, 16, 3, bf16),
        MLASpec("wrapper", "packed", "causal", 32, 3, 64, 3, bf16),
        MLASpec("wrapper", "fixed", "dense", 16, 1, 128, 4, fp16, out_dtype=fp16),
    ]
    return [s.case() for s in specs]


for _case in _mla_cases():
    register(_case.api, [_case])


# ----------------------------------------------------------------------------
# Paged block-sparse attention (SPEC §5): the one-shot and the wrapper's run
# ----------------------------------------------------------------------------

BSR_APIS = {"oneshot": "block_sparse_attention_with_paged_kv_cache", "wrapper": "BlockSparsePagedTSWrapper"}
_PAGE_GARBAGE = (-1, 2 ** 31 - 1)  # CSR entries past a request's live pages
_BLOCK_GARBAGE = (-7, 2 ** 31 - 1)  # block_indices entries outside every route row


def bsr_routes(lens: Sequence[int], sq: int, hkv: int, q_block: int, kv_block: int, g: torch.Generator,
               density: float = 0.5, empty: bool = False) -> List[List[List[List[int]]]]:
    """routes[b][h][r]: sorted block IDs; each block of request b (those starting before its
    length) with probability ``density``, the blocks holding row r's bottom-right diagonal
    keys always. ``empty``: request 0's last K/V head has an empty last row and request 1's
    first K/V head selects nothing at all (those query rows write zeros)."""
    n_rows = -(-sq // q_block)
    routes = []
    for b, sk in enumerate(lens):
        nblk = -(-sk // kv_block)
        heads = []
        for h in range(hkv):
            rows = []
            for r in range(n_rows):
                sel = set((torch.rand(nblk, generator=g) < density).nonzero().flatten().tolist())
                t0, t1 = r * q_block, min(sq, (r + 1) * q_block)
                lo, hi = max(0, sk - sq + t0), min(sk - 1, max(0, sk - sq + t1 - 1))
                sel |= set(range(lo // kv_block, hi // kv_block + 1))
                if empty and ((b == 0 and h == hkv - 1 and r == n_rows - 1) or (b == 1 and h == 0)):
                    sel = set()
                rows.append(sorted(sel))
            heads.append(rows)
        routes.append(heads)
    return routes


def bsr_tensors(routes, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(block_indptr [B, Hkv, R + 1] of absolute offsets, block_indices) for routes[b][h][r], the
    (b, h) segments back to back, two garbage block IDs after the last one."""
    ptr, flat = [], []
    for heads in routes:
        ptr.append([])
        for rows in heads:
            offs = [len(flat)]
            for row in rows:
                flat += row
                offs.append(len(flat))
            ptr[-1].append(offs)
    flat += list(_BLOCK_GARBAGE)
    return (torch.tensor(ptr, dtype=torch.int32, device=device),
            torch.tensor(flat, dtype=torch.int32, device=device))


def bsr_valid_bits(batch: int, words: int, g: torch.Generator, device, kind: str) -> torch.Tensor:
    """kv_valid_bits ``[batch, words]``: each bit set with probability 0.75, the first word's top bit
    set; ``kind`` "int32" or "uint32" (the same bits)."""
    on = (torch.rand(batch, words, 32, generator=g) < 0.75).to(torch.int64)
    w = (on << torch.arange(32)).sum(-1)
    w[0, 0] |= 1 << 31  # a word with the top bit set
    bits = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32).to(device)
    return bits.view(torch.uint32) if kind == "uint32" else bits


@dataclass(frozen=True)
class BlockSparseSpec:
    entry: str  # "oneshot" | "wrapper" (plan, then run(out=))
    mask: str  # "dense" | "causal"
    head_dim: int
    hq: int
    hkv: int
    q_block: int
    kv_block: int
    page_size: int
    combined: bool  # [P, 2, Hkv, ps, D] or a (K, V) tuple
    dtype: torch.dtype
    bits: Optional[str] = None  # kv_valid_bits: None | "uint32" | "int32"
    empty: bool = False  # an empty route row and a K/V head with no blocks (see bsr_routes)
    sq1: bool = False  # Sq = 1
    out_dtype: Optional[torch.dtype] = None

    def sizes(self, small: bool):
        """(Sq, K/V lengths, max_seq_len_kv): lengths not page or block multiples, Sq <= every length,
        max_seq_len_kv above the longest (spare valid-bit words)."""
        sq = 1 if self.sq1 else (40 if small else 300)
        lens = [300, 61] if small else [1000, 333, 777]
        return sq, lens, max(lens) + 37

    def name(self) -> str:
        group = self.hq // self.hkv
        heads = "MHA" if group == 1 else f"GQA{group}"
        extra = f" bits={self.bits}" if self.bits else ""
        extra += " empty" if self.empty else ""
        extra += " Sq1" if self.sq1 else ""
        extra += f" out={_dt(self.out_dtype)}" if self.out_dtype is not None else ""
        return (f"{self.mask} D{self.head_dim} {heads} qb{self.q_block} kvb{self.kv_block} page{self.page_size} "
                f"{'combined' if self.combined else 'tuple'}{extra}")

    def describe(self, small: bool) -> str:
        sq, lens, _ = self.sizes(small)
        return f"Sq{sq} lens{lens} H{self.hq}/{self.hkv}".replace(", ", ",")

    def run(self, device: torch.device, small: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        import prims_ts
        from prims_ts import reference

        g = _gen(_seed(self.entry + " " + self.name()))
        ps, d, dt, hq, hkv = self.page_size, self.head_dim, self.dtype, self.hq, self.hkv
        sq, lens, max_len = self.sizes(small)
        b = len(lens)
        need = [(n + ps - 1) // ps for n in lens]
        pool = sum(need) + 2  # two pages no request uses
        perm = torch.randperm(pool, generator=g).tolist()
        indices, entries, live, at = [], [], [], 0
        for i, n in enumerate(need):  # shuffled pages, garbage CSR entries past the live ones
            live.append(perm[at:at + n])
            at += n
            slack = [_PAGE_GARBAGE[i % 2]] * (i % 2 + 1)
            indices += live[i] + slack
            entries.append(n + len(slack))
        indptr = torch.tensor(entries, dtype=torch.int64).cumsum(0)
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), indptr]).to(torch.int32).to(device)
        indices = torch.tensor(indices, dtype=torch.int32, device=device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        if self.combined:
            cache = _randn((pool, 2, hkv, ps, d), dt, device, g)
            k, v = cache[:, 0], cache[:, 1]
        else:
            k, v = _randn((pool, hkv, ps, d), dt, device, g), _randn((pool, hkv, ps, d), dt, device, g)
            cache = (k, v)
        used = torch.zeros(pool, ps, dtype=torch.bool)
        for i, n in enumerate(lens):
            j = torch.arange(n)
            used[torch.tensor(live[i])[j // ps], j % ps] = True
        unused = (~used).to(device)[:, None, :, None].expand_as(k)
        k.masked_fill_(unused, float("nan"))  # unused slots: never read
        v.masked_fill_(unused, float("nan"))
        routes = bsr_routes(lens, sq, hkv, self.q_block, self.kv_block, g, empty=self.empty)
        block_indptr, block_indices = bsr_tensors(routes, device)
        bits = bsr_valid_bits(b, -(-max_len // 32), g, device, self.bits) if self.bits is not None else None
        q = _randn((b, sq, hq, d), dt, device, g)
        out = _poisoned(q.shape, self.out_dtype or dt, device)
        if self.entry == "oneshot":
            res = prims_ts.block_sparse_attention_with_paged_kv_cache(
                q, cache, indptr, indices, block_indptr, block_indices, self.q_block, self.kv_block,
                max_seq_len_kv=max_len, seq_lens_kv=seq_lens, kv_valid_bits=bits, mask_type=self.mask, out=out)
        else:
            w = prims_ts.BlockSparsePagedTSWrapper()
            most = max((len(row) for per_b in routes for per_h in per_b for row in per_h), default=0)
            w.plan(indptr, sq, max_len, hq, hkv, d, self.q_block, self.kv_block, ps, max_blocks_per_row=most,
                   use_kv_valid_bits=bits is not None, seq_lens_kv=seq_lens, mask_type=self.mask, q_data_type=dt,
                   o_data_type=self.out_dtype)
            res = w.run(q, cache, indices, block_indptr, block_indices, kv_valid_bits=bits, out=out)
        if res is not out:
            raise AssertionError(f"{BSR_APIS[self.entry]}(out=...) must return out itself")
        ref = reference.block_sparse_attention(q, k, v, indptr, indices, block_indptr, block_indices, self.q_block,
                                               self.kv_block, seq_lens, kv_valid_bits=bits, mask_type=self.mask,
                                               compute_dtype=torch.float64)
        return out, ref

    def case(self) -> CheckCase:
        return CheckCase(BSR_APIS[self.entry], self.name(), self.dtype, self.run, self.describe)


def _block_sparse_cases() -> List[CheckCase]:
    bf16, fp16 = torch.bfloat16, torch.float16
    S = BlockSparseSpec
    specs = [
        S("oneshot", "dense", 128, 8, 2, 16, 8, 16, True, bf16, empty=True),
        S("oneshot", "causal", 128, 4, 4, 32, 32, 32, False, bf16, bits="uint32"),
        S("oneshot", "causal", 128, 32, 8, 64, 64, 64, True, bf16, empty=True),
        S("oneshot", "dense", 256, 8, 2, 128, 128, 128, False, bf16, bits="int32", empty=True),
        S("oneshot", "causal", 256, 4, 4, 8, 8, 16, True, fp16, bits="uint32", empty=True),
        S("oneshot", "dense", 128, 8, 2, 24, 192, 64, False, bf16),
        S("wrapper", "dense", 128, 8, 8, 64, 128, 32, False, fp16, empty=True),
        S("wrapper", "causal", 128, 16, 4, 2, 64, 64, True, bf16, bits="uint32", sq1=True),
        S("wrapper", "causal", 256, 8, 2, 32, 32, 128, False, bf16, bits="int32", empty=True),
        S("wrapper", "dense", 128, 8, 2, 128, 128, 16, True, bf16, bits="uint32", out_dtype=torch.float32),
    ]
    return [s.case() for s in specs]


for _case in _block_sparse_cases():
    register(_case.api, [_case])


# ----------------------------------------------------------------------------
# Block-sparse attention over contiguous K/V: the one-shot and the wrapper's run
# ----------------------------------------------------------------------------

BSR_CONTIGUOUS_APIS = {"oneshot": "block_sparse_attention", "wrapper": "BlockSparseTSWrapper"}


@dataclass(frozen=True)
class ContiguousBlockSparseSpec:
    entry: str  # "oneshot" | "wrapper" (plan, then run(out=))
    mask: str
    head_dim: int
    hq: int
    hkv: int
    q_block: int
    kv_block: int
    dtype: torch.dtype
    bits: bool = False  # uint32 kv_valid_bits
    empty: bool = False  # an empty route row and a K/V head with no blocks (see bsr_routes)

    def sizes(self, small: bool):
        """(B, Sq, Skv): Skv not a block multiple, Sq <= Skv."""
        return (2, 40, 301) if small else (3, 300, 1029)

    def name(self) -> str:
        group = self.hq // self.hkv
        return (f"{self.mask} D{self.head_dim} {'MHA' if group == 1 else f'GQA{group}'} qb{self.q_block} "
                f"kvb{self.kv_block}" + (" bits" if self.bits else "") + (" empty" if self.empty else ""))

    def describe(self, small: bool) -> str:
        b, sq, skv = self.sizes(small)
        return f"B{b} Sq{sq} Skv{skv} H{self.hq}/{self.hkv}"

    def run(self, device: torch.device, small: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        import prims_ts
        from prims_ts import reference

        g = _gen(_seed("contiguous " + self.entry + " " + self.name()))
        b, sq, skv = self.sizes(small)
        d, dt = self.head_dim, self.dtype
        q = _randn((b, sq, self.hq, d), dt, device, g)
        k, v = _randn((b, skv, self.hkv, d), dt, device, g), _randn((b, skv, self.hkv, d), dt, device, g)
        routes = bsr_routes([skv] * b, sq, self.hkv, self.q_block, self.kv_block, g, empty=self.empty)
        block_indptr, block_indices = bsr_tensors(routes, device)
        bits = bsr_valid_bits(b, -(-skv // 32), g, device, "uint32") if self.bits else None
        out = _poisoned(q.shape, dt, device)
        if self.entry == "oneshot":
            res = prims_ts.block_sparse_attention(q, k, v, block_indptr, block_indices, self.q_block, self.kv_block,
                                                  kv_valid_bits=bits, mask_type=self.mask, out=out)
        else:
            w = prims_ts.BlockSparseTSWrapper()
            w.plan(b, sq, skv, self.hq, self.hkv, d, self.q_block, self.kv_block, device=device,
                   max_blocks_per_row=-(-skv // self.kv_block), use_kv_valid_bits=bits is not None,
                   mask_type=self.mask, q_data_type=dt)
            res = w.run(q, k, v, block_indptr, block_indices, kv_valid_bits=bits, out=out)
        if res is not out:
            raise AssertionError(f"{BSR_CONTIGUOUS_APIS[self.entry]}(out=...) must return out itself")
        ref = reference.block_sparse_attention_contiguous(q, k, v, block_indptr, block_indices, self.q_block,
                                                          self.kv_block, kv_valid_bits=bits, mask_type=self.mask,
                                                          compute_dtype=torch.float64)
        return out, ref

    def case(self) -> CheckCase:
        return CheckCase(BSR_CONTIGUOUS_APIS[self.entry], self.name(), self.dtype, self.run, self.describe)


def _contiguous_block_sparse_cases() -> List[CheckCase]:
    bf16, fp16 = torch.bfloat16, torch.float16
    S = ContiguousBlockSparseSpec
    specs = [
        S("oneshot", "dense", 128, 8, 2, 16, 8, bf16, empty=True),
        S("oneshot", "causal", 128, 32, 8, 64, 128, bf16, bits=True),
        S("oneshot", "causal", 256, 4, 4, 8, 64, fp16, empty=True),
        S("wrapper", "dense", 128, 16, 2, 128, 64, bf16, bits=True, empty=True),
        S("wrapper", "causal", 256, 8, 8, 32, 32, bf16),
    ]
    return [s.case() for s in specs]


for _case in _contiguous_block_sparse_cases():
    register(_case.api, [_case])
