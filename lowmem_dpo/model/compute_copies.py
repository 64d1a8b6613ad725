"""The LoRA weights in the compute dtype: a 16-bit copy the forward reads as it is, float32 weights the optimizer
updates. No cast in any forward, recompute or backward.

    copies = ComputeCopies(model, torch.bfloat16)   # train in a 16-bit dtype (training/policy.trainee)
    loss.backward(); copies.accumulate()            # each micro-batch (step.Trainee.backward): into the .grad
    copies.refresh()                                # after the optimizer changed the weights (step.optimizer_step, a resume)

Why. The 16-bit forward (devices.autocast) used to cast each float32 LoRA weight where it was used, and autocast
keeps a cast only while its context lasts: every checkpointed layer's recompute cast its weights again, and each
cast ran again in backward for the gradient (~54 casts per decoder layer per step on a GPU). TRL keeps a
quantized base's adapter in bf16 and updates it there, where AdamW's small steps round away (bf16 keeps 8 bits of
mantissa: an update below 1/256 of a weight is lost). Here the forward reads a 16-bit copy of every trainable LoRA
weight, held in one flat buffer; each backward leaves the copies' gradients in another, which one cast adds into
the float32 weights' .grad (a flat buffer too), which the optimizer, the clipping, the loss scaler and the sum
across processes read as before; after the update one cast refreshes the copies. A checkpoint and the adapter
save the float32 weights, as before.

The numbers are the same as autocast's: the forward reads the same rounding of the same weights, each
micro-batch's gradient is the same 16-bit matmul's, and the micro-batches' gradients add up in float32 (an MLP in
tiles sums its tiles' in float32 and rounds them once: activations.TiledMLP). A float16 run (a T4, without bf16)
gets the same: float16 copies, gradients scaled by the loss scale as before. One difference: a weight no forward
of a step reads gets a zero gradient where it had none (every LoRA weight of the supported models is read).

Memory: the copies and their gradients, 2 x 2 bytes a trainable parameter on the device (84 MiB each for
Llama-3.1-8B's r=16 adapter; the memory model counts them in lora_params and lora_grads), and a float32
concatenation of the weights while they are refreshed, after the update. Outside a step (eval, samples) the
forward reads the same copies; in float32 nothing changes.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

COMPUTE_DTYPES = (torch.bfloat16, torch.float16)
_COPY_OF = WeakTensorKeyDictionary()  # a weight -> its compute copy, by identity
_ALL: "weakref.WeakSet[ComputeCopies]" = weakref.WeakSet()  # every live set of copies (is_copy reads them)


def is_copy(t: torch.Tensor) -> bool:
    """Whether `t` is a compute copy (a weight, which activations.Offloader leaves where it is)."""
    ptr = t.untyped_storage().data_ptr()
    return any(c.flat.numel() and ptr == c.flat.untyped_storage().data_ptr() for c in _ALL)


def read_by_forward(param: torch.Tensor) -> torch.Tensor:
    """What the forward reads for a trainable weight: its compute copy, or the weight itself (float32, or none
    made): the tensor whose .grad its gradient goes to (activations.TiledMLP's backward asks)."""
    return _COPY_OF.get(param, param)


def lora_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The nn.Linear modules of every peft LoRA layer's A and B (lora_A, lora_B: one per adapter name) whose weight
    is trained."""
    out = []
    for module in model.modules():
        for name in ("lora_A", "lora_B"):
            parts = getattr(module, name, None)
            if isinstance(parts, torch.nn.ModuleDict):
                out += [linear for linear in parts.values()
                        if type(linear) is torch.nn.Linear and linear.weight.requires_grad]
    return out


class ComputeCopies:
    """16-bit copies of a model's trainable LoRA weights, which its LoRA Linears read (module doc)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        linears = lora_linears(model) if dtype in COMPUTE_DTYPES else []
        self.params = [t for linear in linears for t in (linear.weight, linear.bias)
                       if t is not None and t.requires_grad]
        n = sum(p.numel() for p in self.params)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.flat = torch.empty(n, dtype=dtype, device=device)  # (n,) every copy, one after the other
        self.flat_grad = torch.zeros(n, dtype=dtype, device=device)  # (n,) their gradients
        self.flat_grad32 = torch.zeros(n, dtype=torch.float32, device=device)  # (n,) the float32 weights' .grad
        self.copies, self.grads32, self.flat_params = {}, [], []
        _ALL.add(self)
        start = 0
        for p in self.params:
            end = start + p.numel()
            # Leaves of their own (detach: views of the buffers to memory, not to autograd)
            copy = self.copies[id(p)] = _COPY_OF[p] = self.flat[start:end].view_as(p).detach().requires_grad_()
            copy.grad = self.flat_grad[start:end].view_as(p).detach()  # autograd adds into it in place
            self.grads32.append(self.flat_grad32[start:end].view_as(p).detach())
            start = end
        self.refresh()
        for linear in linears:
            linear.forward = functools.partial(self.forward, linear)  # the instance's forward, not the class's

    def refresh(self) -> None:
        """The copies from the float32 weights: one concatenation, one cast."""
        if not self.params:
            return
        if [v.data_ptr() for v in self.flat_params] != [p.data_ptr() for p in self.params]:  # their storage moved
            self.flat_params = [p.detach().reshape(-1) for p in self.params]  # views: (numel,) each
        with torch.no_grad():
            self.flat.copy_(torch.cat(self.flat_params))  # (n,) float32, then cast

    def accumulate(self) -> None:
        """After a backward: the copies' gradients added into the float32 weights' .grad (one cast), the copies'
        cleared. A step's first backward (no weight holds its .grad view: zero_grad dropped them) starts the sums
        over; a .grad set some other way is added in, not lost."""
        if not self.params:
            return
        with torch.no_grad():
            if all(p.grad is not g for p, g in zip(self.params, self.grads32)):
                self.flat_grad32.copy_(self.flat_grad)
            else:
                self.flat_grad32.add_(self.flat_grad)
            for p, g in zip(self.params, self.grads32):
                if p.grad is not g:
                    if p.grad is not None:
                        g.add_(p.grad)
                    p.grad = g
            self.flat_grad.zero_()

    def zero_grad(self) -> None:
        """Drop what the copies' gradients hold (an out-of-memory retry of a step starts over)."""
        self.flat_grad.zero_()

    def forward(self, linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        weight = self.copies.get(id(linear.weight))
        if weight is None or (x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type)):
            return torch.nn.Linear.forward(linear, x)  # a float32 forward: the weights as they are
        # (under autocast, F.linear casts a float32 x to the compute dtype, as it did with the float32 weight)
        bias = linear.bias
        if bias is not None:
            bias = self.copies.get(id(bias)) if id(bias) in self.copies else bias.to(x.dtype)
        return F.linear(x, weight, bias)

