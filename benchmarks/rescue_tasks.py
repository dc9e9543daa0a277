"""Tiny CPU training tasks for the rescue benchmark: a model, a data stream, a held-out eval.

Every batch is a pure function of (config seed, loop step, micro-batch), drawn from its own
generator, so every method sees the same data at the same loop step whatever it did before, and
nothing touches the global RNG after the model is built. A task's loss is a weighted mean over
samples (``batch["w"]``, absent when healthy), so a fault can give a batch bad sample weights.

Tasks (``make_task(config)``): ``regression`` (teacher MLP + noise, MSE), ``classify`` (Gaussian
clusters with label noise, CE), ``chargpt`` (examples/tinygpt.py on the stdlib's source),
``cnn`` (shifted templates, conv + BatchNorm), ``lstm`` (a delayed-recall sequence task),
``gauss_nll`` (heteroscedastic regression, a loss that goes below zero), ``gan`` (a ring of 2-D
Gaussians, generator and discriminator), ``bandit`` (REINFORCE on a contextual bandit whose payouts
are rare and large). Stages (``config["task"]["stages"]``: a domain switch,
a curriculum) change the data at given loop steps; the eval set is the last stage's.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from tinygpt import GPT, GPTConfig, stdlib_text  # noqa: E402

EVAL_N = 512


def gen(*keys) -> torch.Generator:
    """A generator seeded from ``keys`` (stable across processes, unlike ``hash``)."""
    h = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))
    return g


def weighted_mean(per_sample: torch.Tensor, batch: dict) -> torch.Tensor:
    w = batch.get("w")
    if w is None:
        return per_sample.mean()
    w = w.reshape(w.shape + (1,) * (per_sample.dim() - w.dim())).expand_as(per_sample)
    return (w * per_sample).sum() / w.sum()


def mlp(d_in: int, width: int, depth: int, d_out: int, act: str = "relu") -> nn.Sequential:
    acts = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), acts[act]()]
        d = width
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers)


class Teacher:
    """A fixed random tanh MLP with unit output std; ``freq`` > 1 makes it harder to fit."""

    def __init__(self, d_in: int, seed, freq: float = 1.0, width: int = 32):
        g = gen("teacher", seed)
        self.w1 = torch.randn(d_in, width, generator=g) * freq / math.sqrt(d_in)
        self.b1 = torch.randn(width, generator=g) * 0.5
        self.w2 = torch.randn(width, 1, generator=g) / math.sqrt(width)
        x = torch.randn(2048, d_in, generator=g)
        self.scale = 1.0
        self.scale = 1.0 / float(self(x).std())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1 + self.b1) @ self.w2 * self.scale


class Task:
    """One training setup. ``models[k]`` is trained by optimizer ``k`` on ``params(k)``."""

    n_opt = 1
    clip: float | None = None  # the loop's clip_grad_norm_ max norm
    float_inputs: tuple[str, ...] = ("x",)  # batch entries a data fault may corrupt

    def __init__(self, cfg: dict, seed: int):
        self.cfg, self.seed = cfg, seed
        self.stages = [int(s) for s in cfg.get("stages", [])]  # loop steps where a new stage begins
        self.phase_end = cfg.get("phase_end")  # a loop step from which the first stage's data is back
        self.models: list[nn.Module] = []
        self.pools: dict[int, dict] = {}  # stage -> its fixed training set (cfg["pool"]), drawn once

    def stage(self, it: int) -> int:
        if self.phase_end is not None and it >= self.phase_end:
            return 0
        return sum(it >= s for s in self.stages)

    @property
    def last_stage(self) -> int:
        """The stage the run ends in (its eval set's)."""
        return 0 if self.phase_end is not None else len(self.stages)

    def params(self, k: int) -> list[nn.Parameter]:
        return list(self.models[k].parameters())

    def pretrain(self) -> None:
        """Fine-tuning (``cfg["finetune"]``): the whole model trains on stage 0 first (plain
        Adam), then the head is re-initialised and the backbone frozen until ``unfreeze``."""
        ft = self.cfg.get("finetune")
        if not ft:
            return
        model = self.models[0]
        opt = torch.optim.Adam(model.parameters(), lr=2e-3)
        for it in range(ft["pretrain"]):
            opt.zero_grad(set_to_none=True)
            self.loss(0, self.sample(gen(self.seed, "pretrain", it), 2 * self.cfg["batch"], 0)).backward()
            opt.step()
        model.requires_grad_(False)
        model[-1].reset_parameters()
        model[-1].requires_grad_(True)

    def at_step(self, it: int) -> None:
        """Loop-owned events of the run: the late unfreeze of a fine-tuning run."""
        ft = self.cfg.get("finetune")
        if ft and it == ft["unfreeze"]:
            self.models[0].requires_grad_(True)

    def batch(self, it: int, micro: int, k: int = 0) -> dict:
        n = self.cfg["batch"]
        ramp = self.cfg.get("batch_at")
        if ramp and it >= ramp[0]:
            n = ramp[1]
        g = gen(self.seed, "train", it, micro, k)
        if self.cfg.get("pool"):  # a fixed training set, batches drawn from it with replacement
            idx = torch.randint(0, self.cfg["pool"], (n,), generator=g)
            return {key: v[idx] for key, v in self.pool_of(self.stage(it)).items()}
        return self.sample(g, n, self.stage(it))

    def pool_of(self, stage: int) -> dict:
        """``cfg["pool"]`` samples of ``stage``: the whole training set of a run that memorizes it
        (a new one from each stage on). Kept on the task, not in a functools cache, which would
        keep every task and its models alive in a worker process."""
        if stage not in self.pools:
            g = gen(self.seed, "pool") if stage == 0 else gen(self.seed, "pool", stage)
            self.pools[stage] = self.sample(g, self.cfg["pool"], stage)
        return self.pools[stage]

    def sample(self, g: torch.Generator, n: int, stage: int) -> dict:
        raise NotImplementedError

    def loss(self, k: int, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    @functools.cached_property
    def eval_batch(self) -> dict:
        return self.sample(gen(self.seed, "eval"), EVAL_N, self.last_stage)

    @torch.no_grad()
    def evaluate(self) -> float:
        modes = [m.training for m in self.models]
        for m in self.models:
            m.eval()
        try:  # a run on a fixed training set is judged on it (what it optimizes: memorizing it)
            return float(self.loss(0, self.pool_of(self.last_stage) if self.cfg.get("pool") else self.eval_batch))
        finally:
            for m, mode in zip(self.models, modes):
                m.train(mode)


class Regression(Task):
    """y = teacher(x) + noise (Gaussian; Student-t with ``noise_df``), MSE. Stage kinds:
    ``targets`` (a second teacher added, weight ``size``), ``harder`` (a high-frequency teacher
    added), ``inputs`` (the inputs move by ``size`` and stretch)."""

    def __init__(self, cfg: dict, seed: int):
        super().__init__(cfg, seed)
        d = cfg["d_in"]
        self.teacher = Teacher(d, (seed, 0))
        self.extra = [Teacher(d, (seed, i + 1), freq=2.5 if s["kind"] == "harder" else 1.0)
                      for i, s in enumerate(cfg.get("stage_kinds", []))]
        self.shift = torch.randn(d, generator=gen(seed, "shift"))
        self.shift /= self.shift.norm()
        torch.manual_seed(seed)
        self.models = [mlp(d, cfg["width"], cfg["depth"], self.n_out, cfg.get("act", "relu"))]

    n_out = 1

    def inputs_targets(self, g: torch.Generator, n: int, stage: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, self.cfg["d_in"], generator=g)
        kinds = self.cfg.get("stage_kinds", [])[:stage]
        for s in kinds:
            if s["kind"] == "inputs":
                x = x * (1 + 0.5 * s["size"]) + self.shift * 2.0 * s["size"]
        y = self.teacher(x)
        for s, t in zip(kinds, self.extra):
            if s["kind"] in ("targets", "harder"):
                y = y + s["size"] * t(x)
        return x, y

    def sample(self, g, n, stage):
        x, y = self.inputs_targets(g, n, stage)
        noise = torch.randn(y.shape, generator=g)
        df = self.cfg.get("noise_df")
        if df:  # Student-t: a normal over sqrt(chi2_df / df), chi2 as a gamma draw
            chi2 = torch._standard_gamma(torch.full(y.shape, df / 2.0), generator=g) * 2.0
            noise = noise / torch.sqrt(chi2 / df).clamp_min(1e-6)
        return {"x": x, "y": y + self.cfg["noise"] * noise}

    def loss(self, k, batch):
        return weighted_mean(F.mse_loss(self.models[0](batch["x"]), batch["y"], reduction="none"), batch)


class MultiHead(nn.Module):
    """A shared trunk with a main head and an auxiliary one."""

    def __init__(self, d: int, width: int, depth: int, act: str):
        super().__init__()
        self.trunk = mlp(d, width, depth - 1, width, act) if depth > 1 else nn.Linear(d, width)
        self.act = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}[act]()
        self.main = nn.Linear(width, 1)
        self.aux = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.trunk(x))


class MultiTask(Regression):
    """Regression with an auxiliary task (its own teacher, scaled by ``aux["scale"]``) that only
    a fraction ``aux["p"]`` of the steps train, at loss weight ``aux["weight"]`` -- a rarely
    sampled task of a multi-task mix: on its steps the loss jumps and its head, idle (no
    gradient) the rest of the time, gets one. Eval: both tasks."""

    def __init__(self, cfg: dict, seed: int):
        super().__init__(cfg, seed)
        self.aux_teacher = Teacher(cfg["d_in"], (seed, "aux"))
        torch.manual_seed(seed)
        self.models = [MultiHead(cfg["d_in"], cfg["width"], cfg["depth"], cfg.get("act", "relu"))]

    def sample(self, g, n, stage):
        b = super().sample(g, n, stage)
        b["y2"] = self.cfg["aux"]["scale"] * self.aux_teacher(b["x"]) + self.cfg["noise"] * torch.randn(b["y"].shape, generator=g)
        b["aux"] = torch.rand((), generator=g) < self.cfg["aux"]["p"]
        return b

    @functools.cached_property
    def eval_batch(self):
        b = self.sample(gen(self.seed, "eval"), EVAL_N, self.last_stage)
        b["aux"] = torch.tensor(True)
        return b

    def loss(self, k, batch):
        m = self.models[0]
        h = m(batch["x"])
        loss = weighted_mean(F.mse_loss(m.main(h), batch["y"], reduction="none"), batch)
        if bool(batch["aux"]):
            loss = loss + self.cfg["aux"]["weight"] * weighted_mean(F.mse_loss(m.aux(h), batch["y2"], reduction="none"), batch)
        return loss


class GaussNLL(Regression):
    """Heteroscedastic regression: the model predicts a mean and a log-variance; with a small
    noise the Gaussian NLL goes below zero as it trains."""

    n_out = 2

    def __init__(self, cfg, seed):
        super().__init__(cfg, seed)
        self.noise_teacher = Teacher(cfg["d_in"], (seed, "noise"))

    def sample(self, g, n, stage):
        x, y = self.inputs_targets(g, n, stage)
        std = self.cfg["noise"] * torch.exp(0.5 * self.noise_teacher(x))
        return {"x": x, "y": y + std * torch.randn(y.shape, generator=g)}

    def loss(self, k, batch):
        out = self.models[0](batch["x"])
        var = torch.exp(out[:, 1:].clamp(-12, 12))
        return weighted_mean(F.gaussian_nll_loss(out[:, :1], batch["y"], var, reduction="none"), batch)


class Classify(Task):
    """Gaussian clusters (two per class), labels flipped uniformly with probability
    ``label_noise``; eval on clean labels. Stage kinds: ``coarse`` (a curriculum: before the
    stage, groups of ``factor`` classes share one label), ``relabel`` (a fraction ``size`` of the classes swap
    labels), ``inputs`` (every cluster moves by ``size``)."""

    def __init__(self, cfg: dict, seed: int):
        super().__init__(cfg, seed)
        k, d = cfg["classes"], cfg["d_in"]
        g = gen(seed, "centers")
        self.centers = torch.randn(k * 2, d, generator=g) * cfg["spread"] / math.sqrt(d) * 2
        self.moves = torch.randn(k * 2, d, generator=g) / math.sqrt(d)
        self.perms = [torch.randperm(k, generator=g) for _ in range(4)]
        torch.manual_seed(seed)
        self.models = [mlp(d, cfg["width"], cfg["depth"], k, cfg.get("act", "relu"))]

    def labelled(self, g, n, stage):
        k = self.cfg["classes"]
        cluster = torch.randint(0, 2 * k, (n,), generator=g)
        y = cluster // 2
        centers = self.centers
        coarse = 1
        for i, s in enumerate(self.cfg.get("stage_kinds", [])):
            if s["kind"] == "coarse" and stage <= i:
                coarse = max(coarse, s["factor"])  # before this stage the labels are merged
            if s["kind"] == "inputs" and stage > i:
                centers = centers + self.moves * s["size"]
            if s["kind"] == "relabel" and stage > i:  # m classes pass their labels round
                chosen = self.perms[i][:max(2, round(s["size"] * k))]
                perm = torch.arange(k)
                perm[chosen] = chosen.roll(1)
                y = perm[y]
        x = centers[cluster] + torch.randn(n, self.cfg["d_in"], generator=g)
        return x, y // coarse * coarse  # a merged group is named by its first class

    def sample(self, g, n, stage):
        x, y = self.labelled(g, n, stage)
        flip = torch.rand(n, generator=g) < self.cfg["label_noise"]
        y = torch.where(flip, torch.randint(0, self.cfg["classes"], (n,), generator=g), y)
        return {"x": x, "y": y}

    @functools.cached_property
    def eval_batch(self):
        x, y = self.labelled(gen(self.seed, "eval"), EVAL_N, self.last_stage)
        return {"x": x, "y": y}

    def loss(self, k, batch):
        return weighted_mean(F.cross_entropy(self.models[0](batch["x"]), batch["y"], reduction="none"), batch)


@functools.lru_cache(maxsize=1)
def _corpus() -> torch.Tensor:
    text = stdlib_text(300_000)
    return torch.tensor([min(ord(c), 127) for c in text], dtype=torch.long)


class CharGPT(Task):
    """examples/tinygpt.py's GPT on the stdlib's source (train: the first 90%, eval: the rest).
    Stage kinds: ``seqlen`` (a curriculum: the sequence length grows to ``block``), ``upper``
    (the text is upper-cased: a new domain), ``reversed`` (the text runs backwards: harder)."""

    float_inputs = ()

    def __init__(self, cfg: dict, seed: int):
        super().__init__(cfg, seed)
        data = _corpus()
        cut = int(len(data) * 0.9)
        self.train_data, self.eval_data = data[:cut], data[cut:]
        self._views: dict = {}
        torch.manual_seed(seed)
        self.models = [GPT(GPTConfig(n_layer=cfg["layers"], n_head=cfg["heads"], n_embd=cfg["embd"],
                                     block_size=cfg["block"]))]

    def _view(self, data: torch.Tensor, stage: int) -> tuple[torch.Tensor, int]:
        block = self.cfg["block"]
        for i, s in enumerate(self.cfg.get("stage_kinds", [])):
            if s["kind"] == "seqlen" and stage <= i:
                block = min(block, s["block"])
            if s["kind"] == "upper" and stage > i:
                data = torch.where((data >= 97) & (data <= 122), data - 32, data)
            if s["kind"] == "reversed" and stage > i:
                data = data.flip(0)
        return data, block

    def _windows(self, data, g, n, stage):
        key = (data.data_ptr(), stage)
        if key not in self._views:
            self._views[key] = self._view(data, stage)
        data, block = self._views[key]
        ix = torch.randint(0, len(data) - block - 1, (n,), generator=g)
        offs = torch.arange(block + 1)
        chunk = data[ix[:, None] + offs]
        return {"x": chunk[:, :-1], "y": chunk[:, 1:]}

    def sample(self, g, n, stage):
        return self._windows(self.train_data, g, n, stage)

    @functools.cached_property
    def eval_batch(self):
        return self._windows(self.eval_data, gen(self.seed, "eval"), 32, self.last_stage)

    def loss(self, k, batch):
        logits = self.models[0](batch["x"])
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["y"].reshape(-1), reduction="none")
        return weighted_mean(ce.view(batch["y"].shape), batch)


class ConvNet(nn.Module):
    def __init__(self, c: int, classes: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.head = nn.Linear(8 * c, classes)

    def forward(self, x):
        return self.head(self.body(x))


class CNN(Task):
    """12x12 images: a smooth template per class, shifted by up to 2 pixels, in noise;
    conv + BatchNorm (train-mode batch statistics, eval-mode running statistics)."""

    def __init__(self, cfg: dict, seed: int):
        super().__init__(cfg, seed)
        g = gen(seed, "templates")
        t = torch.randn(cfg["classes"], 1, 16, 16, generator=g)
        t = F.avg_pool2d(t, 5, stride=1, padding=2)[..., 2:14, 2:14]
        self.templates = t / t.flatten(1).std(1).view(-1, 1, 1, 1)
        torch.manual_seed(seed)
        self.models = [ConvNet(cfg["channels"], cfg["classes"])]

    def sample(self, g, n, stage):
        y = torch.randint(0, self.cfg["classes"], (n,), generator=g)
        sx, sy = torch.randint(-2, 3, (2,), generator=g).tolist()
        x = self.templates[y].roll((sx, sy), dims=(2, 3))
        x = x + self.cfg["noise"] * torch.randn(x.shape, generator=g)
        flip = torch.rand(n, generator=g) < self.cfg.get("label_noise", 0.0)
        y = torch.where(flip, torch.randint(0, self.cfg["classes"], (n,), generator=g), y)
        return {"x": x, "y": y}

    def loss(self, k, batch):
        return weighted_mean(F.cross_entropy(self.models[0](batch["x"]), batch["y"], reduction="none"), batch)


class Recall(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.lstm = nn.LSTM(2, hidden, batch_first=True)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.out(self.lstm(x)[0])


class LSTMRecall(Task):
    """y_t = x_{t-lag}[0] + 0.5 x_{t-lag2}[1] from a noisy 2-D sequence; MSE; the loop clips
    the gradient norm (``clip``)."""

    def __init__(self, cfg: dict, seed: int):
        super().__init__(cfg, seed)
        self.clip = cfg["clip"]
        torch.manual_seed(seed)
        self.models = [Recall(cfg["hidden"])]

    def sample(self, g, n, stage):
        T, a, b = self.cfg["seq"], self.cfg["lag"], self.cfg["lag2"]
        x = torch.randn(n, T + max(a, b), 2, generator=g)
        L = max(a, b)
        y = x[:, L - a:L - a + T, 0] + 0.5 * x[:, L - b:L - b + T, 1]
        return {"x": x[:, L:], "y": (y + 0.1 * torch.randn(y.shape, generator=g)).unsqueeze(-1)}

    def loss(self, k, batch):
        per = F.mse_loss(self.models[0](batch["x"]), batch["y"], reduction="none").mean((1, 2))
        return weighted_mean(per, batch)


class GAN(Task):
    """A bent 2-D Gaussian ("banana": ``(u, bend * (u^2 - 1))`` plus noise, rotated and moved);
    discriminator (optimizer 0, trained first) and
    generator (optimizer 1), the non-saturating loss. Eval: the energy distance between 512 generated and
    512 real points (both fixed)."""

    n_opt = 2

    def __init__(self, cfg: dict, seed: int):
        super().__init__(cfg, seed)
        angle = float(torch.rand((), generator=gen(seed, "rotation"))) * 2 * math.pi
        self.rotation = torch.tensor([[math.cos(angle), math.sin(angle)], [-math.sin(angle), math.cos(angle)]])
        self.offset = torch.randn(2, generator=gen(seed, "offset"))
        torch.manual_seed(seed)
        w = cfg["width"]
        self.models = [mlp(2, w, 2, 1, "relu"), mlp(cfg["z"], w, 2, 2, "relu")]

    def sample(self, g, n, stage):
        u = torch.randn(n, generator=g)
        bend, std = self.cfg["bend"], self.cfg["std"]
        x = torch.stack([u, bend * (u * u - 1)], 1) + std * torch.randn(n, 2, generator=g)
        return {"x": x @ self.rotation + self.offset, "z": torch.randn(n, self.cfg["z"], generator=g)}

    def loss(self, k, batch):
        D, G = self.models
        if k == 0:  # discriminator: real vs (detached) fake
            real = D(batch["x"])
            fake = D(G(batch["z"]).detach())
            per = (F.binary_cross_entropy_with_logits(real, torch.ones_like(real), reduction="none")
                   + F.binary_cross_entropy_with_logits(fake, torch.zeros_like(fake), reduction="none"))
        else:
            fake = D(G(batch["z"]))
            per = F.binary_cross_entropy_with_logits(fake, torch.ones_like(fake), reduction="none")
        return weighted_mean(per.squeeze(-1), batch)

    @torch.no_grad()
    def evaluate(self) -> float:
        b = self.eval_batch
        fake = self.models[1](b["z"])
        real = b["x"]
        if not bool(torch.isfinite(fake).all()):
            return math.nan
        return float(2 * torch.cdist(fake, real).mean() - torch.cdist(fake, fake).mean() - torch.cdist(real, real).mean())


class Bandit(Task):
    """A contextual bandit trained by REINFORCE: ``actions`` arms, the best one for a context the
    argmax of a fixed random linear teacher; the best arm pays ``reward`` with probability ``p``,
    every other arm with probability ``others * p``, else 0. Actions are drawn from the policy
    by inverse CDF on the step's own uniforms (so batch ``it`` is a pure function of the seed,
    the step and the policy), and so are the payouts. Loss: ``-mean((r - b) log pi(a|x))`` with
    ``b`` 0 or the batch's mean reward (``baseline``), minus ``entropy`` times the policy's
    entropy. Eval (it falls as the policy improves): 1 - the policy's expected payout over
    the best arm's, on fixed held-out contexts, computed exactly (no sampling)."""

    float_inputs = ("x",)

    def __init__(self, cfg: dict, seed: int):
        super().__init__(cfg, seed)
        self.teacher = torch.randn(cfg["d_in"], cfg["actions"], generator=gen(seed, "arms"))
        torch.manual_seed(seed)
        self.models = [mlp(cfg["d_in"], cfg["width"], cfg["depth"], cfg["actions"], cfg.get("act", "relu"))]

    def pay_probability(self, x: torch.Tensor) -> torch.Tensor:
        """Per context and arm, the probability that pulling it pays ``reward``."""
        best = (x @ self.teacher).argmax(1)
        prob = torch.full((len(x), self.cfg["actions"]), self.cfg["others"] * self.cfg["p"])
        prob[torch.arange(len(x)), best] = self.cfg["p"]
        return prob

    def sample(self, g, n, stage):
        return {"x": torch.randn(n, self.cfg["d_in"], generator=g), "u": torch.rand(n, generator=g),
                "v": torch.rand(n, generator=g)}

    def loss(self, k, batch):
        logits = self.models[0](batch["x"])
        logp = F.log_softmax(logits, -1)
        with torch.no_grad():
            cdf = logp.exp().cumsum(-1)
            a = (cdf < batch["u"].unsqueeze(1)).sum(1).clamp_max(self.cfg["actions"] - 1)
            pays = batch["v"] < self.pay_probability(batch["x"]).gather(1, a[:, None]).squeeze(1)
            r = pays.float() * self.cfg["reward"]
            if self.cfg["baseline"] == "mean":
                r = r - r.mean()
        per = -r * logp.gather(1, a[:, None]).squeeze(1) + self.cfg["entropy"] * (logp.exp() * logp).sum(-1)
        return weighted_mean(per, batch)

    @torch.no_grad()
    def evaluate(self) -> float:
        x = self.eval_batch["x"]
        logits = self.models[0](x)
        if not bool(torch.isfinite(logits).all()):
            return math.nan
        payout = (F.softmax(logits, -1) * self.pay_probability(x)).sum(1)
        return float(1.0 - payout.mean() / self.cfg["p"])


TASKS = {"regression": Regression, "multitask": MultiTask, "gauss_nll": GaussNLL, "classify": Classify, "chargpt": CharGPT,
         "cnn": CNN, "lstm": LSTMRecall, "gan": GAN,
         "bandit": Bandit}


def make_task(config: dict) -> Task:
    spec = config["task"]
    task = TASKS[spec["name"]](spec, config["seed"])
    task.pretrain()
    return task
