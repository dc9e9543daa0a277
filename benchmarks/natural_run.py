"""The natural-instability benchmark's training loop: one config, one method -> one result.

Methods (rescue_peers.py's where they exist, with its loop interface): ``bare``; ``earlywarn``
(``earlywarn.watch(model, opt, sinks=[])``, its defaults, each block's largest attention logit
reported to it as ``attn_logit_max/blocks.<i>``, as its docs ask a transformer's user to); ``zclip``; ``olmo_skipstep``;
``spam``, ``stable_spam``, ``adagc`` (pytorch-optimizer 4.1.0's ``SPAM``, ``StableSPAM``,
``AdaGC``: their own defaults, with the run's learning rate, betas and weight decay, so only
their clipping and resets differ from bare's AdamW); and the model-side references
``qk_layernorm`` and ``z_loss`` (bare AdamW on the changed model / loss).

Per step, for every method alike and outside it (nothing recorded feeds back into training):
the train cross-entropy, the total gradient norm before any clipping, the learning rate the step
took (read after it: earlywarn may hold it), whether the update was skipped, each attention
block's largest logit, the output logits' max and mean log-partition, the norm of each block's
query and key weights and of the output head, and per weight matrix (q, k and v apart) the
update-to-weight ratio |w_t - w_{t-1}| / |w_{t-1}|. Eval loss on the fixed held-out set at init,
at each quarter of the run and at the end.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
import traceback

import torch

from natural_models import make_task
from rescue_harness import lr_at
from rescue_peers import Earlywarn, Method, OlmoSkipStep, ZClipMethod, total_norm

OPTIMIZER_PEERS = ("zclip", "spam", "stable_spam", "adagc", "olmo_skipstep")
REFERENCES = ("qk_layernorm", "z_loss")
METHODS = ("bare", "earlywarn") + OPTIMIZER_PEERS + REFERENCES
EVAL_POINTS = 4  # eval at each quarter of the run


class PytorchOptimizer(Method):
    """A pytorch-optimizer class in place of AdamW, its own defaults but the run's lr, betas, wd."""

    CLASS = {"spam": "SPAM", "stable_spam": "StableSPAM", "adagc": "AdaGC"}

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def optimizer(self, spec, params):
        import pytorch_optimizer

        cls = getattr(pytorch_optimizer, self.CLASS[self.name])
        return cls(params, lr=spec["lr"], betas=tuple(spec["betas"]), weight_decay=spec["wd"])


class EarlywarnEvents(Earlywarn):
    """rescue_peers' earlywarn method, keeping what each event names (signal, layers, values). Each
    step it reports every block's largest attention logit as its docs show a user doing
    (``ew.report("attn_logit_max/<block>", ...)``, a tensor: no host sync)."""

    def report_attention(self, task) -> None:
        for i, block in enumerate(task.attention_blocks()):
            self.ews[0].report(f"attn_logit_max/blocks.{i}", block.logit_max)

    def close(self):
        out = super().close()
        out["events"] = [{"step": int(e.step), "kind": str(e.kind), "level": str(e.level), "message": e.message,
                          "signal": e.signal, "layers": list(e.layers),
                          "values": {k: _short(float(v)) for k, v in e.values.items()}}
                         for ew in self.ews for e in ew.events]
        return out


def make_method(name: str) -> Method:
    if name in PytorchOptimizer.CLASS:
        return PytorchOptimizer(name)
    classes = {"earlywarn": EarlywarnEvents, "zclip": ZClipMethod, "olmo_skipstep": OlmoSkipStep}
    if name in METHODS:
        return classes.get(name, Method)()
    raise ValueError(f"unknown method {name!r}: choose from {', '.join(METHODS)}")


class Recorder:
    """The per-step signals, as one tensor row a step (read to the host once, at the end)."""

    def __init__(self, task) -> None:
        self.task = task
        self.blocks = task.attention_blocks()
        named = [(n, p) for n, p in task.model.named_parameters() if p.dim() == 2 and n.endswith("weight")]
        self.params = [p for _, p in named]
        self.prev = [p.detach().clone() for p in self.params]
        # the pieces the update ratio is taken of: an attention block's stacked q/k/v weight, split
        self.pieces: list[tuple[str, int, slice]] = []
        for i, (n, p) in enumerate(named):
            if n.endswith("attn.weight"):
                d = p.shape[1]
                self.pieces += [(n[:-len("attn.weight")] + part, i, slice(j * d, (j + 1) * d))
                                for j, part in enumerate(("q", "k", "v"))]
            else:
                self.pieces.append((n[:-len(".weight")], i, slice(None)))
        L = len(self.blocks)
        self.columns = (["loss", "loss_total", "grad_norm", "lr", "skipped", "out_max", "lse_mean", "head_norm"]
                        + [f"attn_max/{i}" for i in range(L)] + [f"q_norm/{i}" for i in range(L)]
                        + [f"k_norm/{i}" for i in range(L)] + [f"update/{n}" for n, _, _ in self.pieces])
        self.rows: list[torch.Tensor] = []

    @torch.no_grad()
    def before_step(self) -> None:
        torch._foreach_copy_(self.prev, [p.detach() for p in self.params])

    @torch.no_grad()
    def after_step(self, ce, total, grad_norm, lr: float, skipped: bool, logits) -> None:
        diffs = torch._foreach_sub([p.detach() for p in self.params], self.prev)
        num = torch._foreach_norm([diffs[i][sl] for _, i, sl in self.pieces])
        den = torch._foreach_norm([self.prev[i][sl] for _, i, sl in self.pieces])
        qk = [w for pair in self.task.qk_weights() for w in pair]
        qk_norms = torch._foreach_norm([w.detach() for w in qk])
        head = self.task.head_weight().detach().norm()
        fixed = torch.stack([ce, total.detach(), grad_norm, torch.tensor(lr), torch.tensor(float(skipped)),
                             logits.amax(), torch.logsumexp(logits, -1).mean(), head])
        self.rows.append(torch.cat([fixed, torch.stack([b.logit_max for b in self.blocks]),
                                    torch.stack(qk_norms[0::2]), torch.stack(qk_norms[1::2]),
                                    torch.stack(num) / torch.stack(den).clamp_min(1e-30)]))

    def table(self) -> dict[str, list]:
        if not self.rows:
            return {c: [] for c in self.columns}
        values = torch.stack(self.rows).T.tolist()
        return {c: [_short(v) for v in col] for c, col in zip(self.columns, values)}


def run_one(config: dict, method: str) -> dict:
    """Train ``config`` with ``method``; the result dict is what the cache stores."""
    torch.set_num_threads(1)
    t0, c0 = time.perf_counter(), time.process_time()
    res = {"id": config["id"], "model": config["task"]["name"], "lr": config["opt"]["lr"], "seed": config["seed"],
           "method": method, "halted": False, "halt_step": None, "halt_message": None, "error": None}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["EARLYWARN_OUTPUT_DIR"] = tmp  # a quarantine file, if any, stays out of the repo
            _train(config, method, res)
    except Exception:
        res["error"] = traceback.format_exc(limit=6)
    res["wall_s"] = round(time.perf_counter() - t0, 3)
    res["cpu_s"] = round(time.process_time() - c0, 3)
    return res


def _train(config: dict, method_name: str, res: dict) -> None:
    import earlywarn

    task = make_task(config, qk_layernorm=method_name == "qk_layernorm", z_loss=method_name == "z_loss")
    steps, spec = config["steps"], config["opt"]
    method = make_method(method_name)
    opt = method.optimizer(spec, task.params(0))
    res["E0"] = task.evaluate()
    method.attach(task, [opt], [None])
    rec = Recorder(task)
    evals, at = [], {round(steps * (i + 1) / EVAL_POINTS) for i in range(EVAL_POINTS)}
    it = -1
    try:
        for it in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(config["sched"], spec["lr"], it, steps)
            opt.zero_grad(set_to_none=True)
            loss, ce, logits = task.loss(task.batch(it))
            method.report_loss(0, loss)
            if isinstance(method, EarlywarnEvents):
                method.report_attention(task)
            loss.backward()
            grad_norm = total_norm(task.params(0))
            norm = method.clip(0)
            before = method.skip_total()
            rec.before_step()
            if method.before_step(0, loss, norm) == "step":
                method.step(0)
            rec.after_step(ce, loss, grad_norm, float(opt.param_groups[0]["lr"]), method.skip_total() > before, logits)
            if it + 1 in at and it + 1 < steps:
                evals.append([it + 1, _short(task.evaluate())])
    except earlywarn.Halt as exc:
        res["halted"], res["halt_step"], res["halt_message"] = True, it, str(exc)
    res.update(method.close())
    res["steps_run"] = it + 1
    res["E"] = task.evaluate()
    res["evals"] = evals + [[it + 1, _short(res["E"])]]
    res["params_finite"] = all(bool(torch.isfinite(p).all()) for p in task.model.parameters())
    res["signals"] = rec.table()


def _short(v: float) -> float | None:
    """``v`` to 4 significant digits (None when non-finite: the cache is plain JSON)."""
    return float(f"{v:.4g}") if math.isfinite(v) else None
