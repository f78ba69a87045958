"""What the kernel tests share: shapes (`Case`), left-padding masks, seeded inputs and gradients of a kernel and of
the naive float64 reference (diff_transformer/kernel_naive.py) on the same inputs."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from helpers import assert_close

PAD = (0, 5)  # left padding per batch row in "padmask" cases


@dataclass(frozen=True)
class Case:
    B: int
    T: int  # queries, the last T of the S keys
    S: int
    H: int  # differential heads h
    KV: int  # key/value heads h_kv
    D: int  # q/k sub-head dim d
    DV: int | None = None  # value head dim; None: 2D
    attn: str = "causal"  # "causal" (no mask: bottom-right causal), "full" (no mask, no causality) or "padmask"
    rows: int | None = None  # query rows per tile of the tiled kernel; None: its default
    N: int | None = None  # noise heads g (grouped differential attention); None: H

    @property
    def noise(self) -> int:
        return self.H if self.N is None else self.N

    @property
    def dv(self) -> int:
        return 2 * self.D if self.DV is None else self.DV

    @property
    def id(self) -> str:
        """e.g. B2-T24-S40-H4-N2-KV1-D16-padmask: S, N, KV, DV, R(ows) and attn only where not the default."""
        parts = [f"B{self.B}", f"T{self.T}", f"S{self.S}" * (self.S != self.T), f"H{self.H}",
                 f"N{self.N}" * (self.N is not None), f"KV{self.KV}" * (self.KV != self.H), f"D{self.D}",
                 f"DV{self.DV}" * (self.DV is not None), f"R{self.rows}" * (self.rows is not None),
                 self.attn * (self.attn != "causal")]
        return "-".join(part for part in parts if part)


def key_valid(case: Case) -> torch.Tensor | None:
    """Bool [B, S] of "padmask" cases, False for row b's first PAD[b] keys (left padding); None otherwise."""
    if case.attn != "padmask":
        return None
    return torch.arange(case.S)[None, :] >= torch.tensor(PAD[: case.B])[:, None]


def padding_mask(case: Case, device: str = "cpu") -> torch.Tensor | None:
    """Bool [B, 1, T, S] (True = may attend) of "padmask" cases: bottom-right causal and `key_valid`; None
    otherwise."""
    valid = key_valid(case)
    if valid is None:
        return None
    causal = torch.ones(case.T, case.S, dtype=torch.bool).tril(case.S - case.T)
    return (causal[None, None] & valid[:, None, None, :]).to(device)


def empty_rows(case: Case) -> torch.Tensor:
    """[B, T]: query rows with no key to attend."""
    mask = padding_mask(case)
    return torch.zeros(case.B, case.T, dtype=torch.bool) if mask is None else ~mask.squeeze(1).any(-1)


def seeded_randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def leaves(case: Case, dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    """Seeded inputs in the kernels' packed layout that require grad: q [B, H + N, T, D] in halves order, keys
    [B, KV, S, 2D] = (k1 | k2), v [B, KV, S, DV], then lambda (fp32, 0.37)."""
    gen = torch.Generator().manual_seed(1234)
    B, T, S, H, KV, D = case.B, case.T, case.S, case.H, case.KV, case.D
    shapes = [(B, H + case.noise, T, D), (B, KV, S, 2 * D), (B, KV, S, case.dv)]
    tensors = [torch.randn(*shape, generator=gen).to(device, dtype) for shape in shapes]
    return [t.requires_grad_() for t in (*tensors, torch.tensor(0.37, device=device))]


def outputs_and_grads(fn: Callable, inputs: list[torch.Tensor], grad_out: torch.Tensor,
                      names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """{names[0]: fn(*inputs), names[i]: the gradient of inputs[i - 1] for the output gradient grad_out}; the
    output alone when `names` has one name."""
    out = fn(*inputs)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype)) if len(names) > 1 else ()
    return dict(zip(names, (out, *grads)))


def check_against_reference(kernel: Callable, reference: Callable, inputs: list[torch.Tensor], grad_out: torch.Tensor,
                            names: tuple[str, ...], dtype: torch.dtype, kind: str, what: str,
                            rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """`outputs_and_grads` of the kernel vs those of the reference on float64 copies of the same inputs, each through
    `assert_close` with TOLERANCES[kind]. rows [B, T]: compare only these rows of an output laid out [B, T, ...]
    (rows without a key to attend are a don't-care of some kernels). Returns the kernel's."""
    got = outputs_and_grads(kernel, inputs, grad_out, names)
    reference_inputs = [t.detach().double().requires_grad_() for t in inputs]
    expected = outputs_and_grads(reference, reference_inputs, grad_out.double(), names)
    for name, actual in got.items():
        keep = rows if name == names[0] and rows is not None else ...
        assert_close(actual[keep], expected[name][keep], dtype, f"{what} {name}", kind)
    return got
