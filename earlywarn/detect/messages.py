"""The detector's alerts in words: one builder per kind of event (the rules that decide them are in
:mod:`earlywarn.detect.general`)."""

from __future__ import annotations

import math

import numpy as np

from earlywarn.detect.findings import Chosen, Deviations, Evidence, Values
from earlywarn.detect.observation import Observation
from earlywarn.detect.state import GRAD, LAYER, LOSS, N_FIXED, NAN
from earlywarn.detect.work import Work
from earlywarn.events import Event, Kind, Level

_ACT = "save a checkpoint now and be ready to rewind; consider lowering the learning rate"


def fmt(x: float) -> str:
    """A value for a message: 3 significant digits, non-finite values as words ("NaN", "inf")."""
    if x != x:
        return "NaN"
    if not math.isfinite(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.3g}"


def times(r: float) -> str:
    """A ratio for a message: "2.4x", or "NaN" / "inf" (never "nanx")."""
    return f"{fmt(r)}x" if math.isfinite(r) else fmt(r)


def layer_of(channel: str) -> str:
    """The layer name of a ``grad_norm/<layer>`` channel."""
    return channel[len(LAYER):]


def warning_event(obs: Observation, w: Work, chosen: "Chosen", d: "Deviations", v: "Values", ev: "Evidence",
                  prev_run: list[float], lr_jump: tuple[float, float] | None, layers: tuple[str, ...]) -> Event:
    """The COLLAPSE_RISK event of the rule ``chosen`` (see general.choose_warning). ``v.given``,
    ``ev.cusums`` and ``prev_run`` hold the run-level channels: the four fixed ones, then the
    user signals."""
    rule, chan = chosen.rule, chosen.chan
    le = w.layers_end

    def run_index(c: int) -> int:  # position of a run-level channel in given / cusums / prev_run
        return c if c < N_FIXED else N_FIXED + c - le

    if rule == "user_value":
        return _with_lr_jump(_user_value_event(obs, w, chan, float(v.given[run_index(chan)])), lr_jump)
    if rule == "lr_jump":
        return _lr_jump_event(obs, *lr_jump)
    dev, z = d.dev, d.z
    streak, grow = w.streak, w.grow
    signal = w.channels[chan]
    dc = float(dev[chan])
    ratio = math.exp(dc) if math.isfinite(dc) else NAN
    base = math.exp(float(v.logv[chan]) - dc) if math.isfinite(dc) else NAN
    if chan == LOSS:
        base -= w.loss_shift
    value = float(v.given[run_index(chan)]) if chan < N_FIXED or chan >= le else NAN
    where = f", led by {layers[0]}" if layers else ""
    if rule == "escalating":
        prev_ratio = math.exp(prev_run[run_index(chan)])
        msg = (f"{signal} is escalating: {times(prev_ratio)} -> {times(ratio)} its baseline "
               f"({fmt(base)} -> {fmt(value)}), {int(grow[chan])} growing steps in a row{where}; "
               f"collapse risk, {_ACT}.")
    elif rule == "jump":
        msg = (f"{signal} jumped to {times(ratio)} its baseline ({fmt(base)} -> {fmt(value)}) "
               f"in one step{where}; collapse risk, {_ACT}.")
    elif rule == "together":
        dl = float(dev[LOSS])
        lr = math.exp(dl) if math.isfinite(dl) else NAN
        msg = (f"{signal} and the loss have been rising together for several steps (now "
               f"{times(ratio)} and {times(lr)} their baselines){where}; collapse risk, {_ACT}.")
    elif rule == "alone":
        msg = (f"{signal} has been rising for several steps, now {times(ratio)} its baseline "
               f"({fmt(base)} -> {fmt(value)}){where}; collapse risk, {_ACT}.")
    else:
        msg = f"{chosen.hot_layers} layers jumped together{where}; collapse risk, {_ACT}."
    zc = float(z[chan])
    return _with_lr_jump(Event(
        step=int(obs.step), kind=Kind.COLLAPSE_RISK, level=Level.WARNING, message=msg,
        signal=signal, layers=layers,
        values={"value": value, "baseline": base, "ratio": ratio,
                "z": zc if math.isfinite(zc) else NAN,
                "cusum": float(ev.joint if rule == "together" else ev.cusums[run_index(chan)]),
                "steps": float(max(streak[chan], grow[chan])),
                "layers_elevated": float(int(np.count_nonzero(d.elevated[N_FIXED:le])))},
        batch=obs.batch), lr_jump)


def _with_lr_jump(e: Event, lr_jump: tuple[float, float] | None) -> Event:
    """A warning of another rule on a step whose learning rate jumped says so too (one warning a
    step: the guard must still know of the jump)."""
    if lr_jump is None:
        return e
    lr, ref = lr_jump
    return Event(step=e.step, kind=e.kind, level=e.level, signal=e.signal, layers=e.layers, batch=e.batch,
                 message=e.message + f" The learning rate jumped too, to {times(lr / ref)} the highest it had run at.",
                 values={**e.values, "lr_jump_ratio": lr / ref, "lr_ref": ref})


def _user_value_event(obs: Observation, w: Work, c: int, v: float) -> Event:
    return Event(
        step=int(obs.step), kind=Kind.COLLAPSE_RISK, level=Level.WARNING, signal=w.channels[c], layers=(),
        message=(f"{w.channels[c]} is {fmt(v)} at step {obs.step} (a signal you report); "
                 f"collapse risk, {_ACT}."),
        values={"value": v, "baseline": math.exp(float(w.baseline[c])) if w.count[c] > 0 else NAN,
                "ratio": NAN, "z": NAN, "cusum": NAN, "steps": 1.0, "layers_elevated": 0.0},
        batch=obs.batch)


def _lr_jump_event(obs: Observation, lr: float, ref: float) -> Event:
    return Event(
        step=int(obs.step), kind=Kind.COLLAPSE_RISK, level=Level.WARNING, signal="lr", layers=(),
        message=(f"The learning rate jumped to {times(lr / ref)} the highest it had run at "
                 f"({fmt(ref)} -> {fmt(lr)}); collapse risk, save a checkpoint now and be "
                 "ready to rewind; check the LR schedule."),
        values={"value": lr, "baseline": ref, "ratio": lr / ref, "z": NAN, "cusum": NAN,
                "steps": 1.0, "layers_elevated": 0.0, "lr_jump_ratio": lr / ref, "lr_ref": ref},
        batch=obs.batch)


def spike_event(obs: Observation, w: Work) -> Event:
    """GRAD_SPIKE: the episode's peak, reported on the step it recovered."""
    chan, peak_step, first = w.ep_peak_chan, w.ep_peak_step, w.ep_first_layer
    signal = w.channels[chan]
    ratio = math.exp(w.ep_peak_dev)
    base = math.exp(float(w.baseline[chan]))
    layers: tuple[str, ...] = ()
    if first >= 0:
        layers = (layer_of(w.channels[first]),)
    if N_FIXED <= chan < w.layers_end and (not layers or layer_of(signal) != layers[0]):
        layers = layers + (layer_of(signal),)
    dur = int(obs.step) - w.ep_start
    where = f" (first in {layers[0]})" if layers else ""
    return Event(
        step=int(obs.step), kind=Kind.GRAD_SPIKE, level=Level.INFO, signal=signal, layers=layers,
        message=(f"Isolated {signal} spike at step {peak_step}: {times(ratio)} its baseline"
                 f"{where}, back to normal after {dur} step{'s' if dur != 1 else ''}; nothing to do "
                 "unless these become frequent."),
        values={"ratio": ratio, "value": ratio * base, "baseline": base,
                "peak_step": float(peak_step), "steps": float(dur)},
        batch=obs.batch)


_JOINED = {
    "new": " Layers without a gradient before have one now: a part of the model starts training.",
    "idle": (" Layers idle for steps have a gradient again: a part of the model that trains only on some "
             "steps (a rarely sampled task, an expert) trains at this one."),
}


def outlier_event(obs: Observation, w: Work, dev: float, loss_ratio: float, layers: tuple[str, ...],
                  joined: str = "", prev_ratio: float = 1.0, prev_elevated: int = 0) -> Event:
    """GRAD_OUTLIER: a finite gradient far above its typical norm, at its own step. ``joined``:
    ``"new"``, layers that never had a gradient have one now (a part of the model unfrozen);
    ``"idle"``, layers idle for a while have one again (see ``general._layers_joined``).
    ``prev_ratio``: the step before's ratio where it was elevated, else 1, and ``prev_elevated``
    the steps in a row it had been elevated (the policy tells a gradient that climbed into the
    outliers from one that jumped there)."""
    base = math.exp(float(w.baseline[GRAD]))
    ratio = math.exp(dev)
    where = f", first in {layers[0]}" if layers else ""
    run = f" ({w.outliers} in a row)" if w.outliers > 1 else ""
    loss = ("; the loss too is " + times(loss_ratio) + " its baseline") if loss_ratio == loss_ratio and loss_ratio >= 1.5 else ""
    why = _JOINED.get(joined, " Applied, it would inflate the optimizer's moments for thousands of steps.")
    return Event(
        step=int(obs.step), kind=Kind.GRAD_OUTLIER, level=Level.WARNING, signal="grad_norm", layers=layers,
        message=(f"Outlier gradient at step {obs.step}: grad_norm {fmt(ratio * base)} is {times(ratio)} its "
                 f"typical {fmt(base)}{where}{run}{loss}.{why}"),
        values={"ratio": ratio, "value": ratio * base, "baseline": base, "loss_ratio": loss_ratio,
                "steps": float(w.outliers), "joined": float(bool(joined)),
                "idle": float(joined == "idle"), "prev_ratio": prev_ratio,
                "prev_elevated": float(prev_elevated)},
        batch=obs.batch)


def early_event(obs: Observation, w: Work, ratio: float, loss: float) -> Event:
    """COLLAPSE_RISK in the first steps: the loss far above its value at initialisation."""
    return Event(
        step=int(obs.step), kind=Kind.COLLAPSE_RISK, level=Level.WARNING, signal="loss", layers=(),
        message=(f"In its first steps the loss rose to {times(ratio)} its value at initialisation "
                 f"({fmt(w.loss_first)} -> {fmt(loss)}) and stayed there: the learning rate is likely far too "
                 "high (or the data or the loss is broken)."),
        values={"value": loss, "baseline": w.loss_first, "ratio": ratio, "z": NAN, "cusum": NAN,
                "steps": float(w.init_high), "layers_elevated": 0.0},
        batch=obs.batch)


def _nonfinite_layers(w: Work, obs: Observation) -> tuple[str, ...]:
    names = w.channels[N_FIXED:w.layers_end]
    if not names:
        return ()
    ln, lnf = obs.layer_norms, obs.layer_nonfinite
    bad = None
    if lnf is not None:
        bad = np.asarray(lnf).astype(bool)
    if ln is not None:
        nf = ~np.isfinite(np.asarray(ln, dtype=np.float64))
        bad = nf if bad is None else (bad | nf)
    if bad is None:
        return ()
    idx = np.flatnonzero(bad)
    if obs.layer_rank is not None and len(obs.layer_rank) == len(names):
        idx = idx[np.argsort(np.asarray(obs.layer_rank)[idx], kind="stable")]  # first reached in backward first
    return tuple(layer_of(names[i]) for i in idx)


def nonfinite_event(obs: Observation, w: Work, count: int, scaler: bool) -> Event:
    """NONFINITE_GRAD: a non-finite gradient (``count`` steps in a row), or a loss scaler that
    keeps overflowing (``scaler``)."""
    layers = _nonfinite_layers(w, obs)
    g = obs.grad_norm
    base = math.exp(w.baseline[GRAD]) if w.count[GRAD] > 0 else NAN
    where = f", first in {layers[0]}" if layers else ""
    if scaler:
        msg = (f"The loss scaler has overflowed {count} steps in a row{where}: gradients are "
               "non-finite at every scale; rewind to the last clean checkpoint and check the "
               "data and the learning rate.")
    else:
        run = f" ({count} steps in a row)" if count > 1 else ""
        msg = (f"Non-finite gradient at step {obs.step}{where}{run}; the step must be skipped, "
               "and if it repeats rewind to the last clean checkpoint.")
    return Event(
        step=int(obs.step), kind=Kind.NONFINITE_GRAD, level=Level.CRITICAL, signal="nonfinite",
        layers=layers, message=msg,
        values={"value": NAN if g is None else float(g), "baseline": base, "ratio": math.inf,
                "nonfinite_layers": float(len(layers)), "steps": float(count)},
        batch=obs.batch)


def overflow_event(obs: Observation, w: Work, prev: float, loss_scale: float, count: int) -> Event:
    layers = _nonfinite_layers(w, obs)
    return Event(
        step=int(obs.step), kind=Kind.SCALER_OVERFLOW, level=Level.INFO, signal="nonfinite",
        layers=layers,
        message=(f"Loss-scaler overflow at step {obs.step} (scale {fmt(prev)} -> {fmt(float(loss_scale))})"
                 f"; the scaler skipped the step, nothing to do unless it repeats."),
        values={"value": float(loss_scale), "baseline": float(prev),
                "ratio": float(loss_scale) / prev if prev and math.isfinite(prev) else NAN,
                "steps": float(count)},
        batch=obs.batch)


def loss_nonfinite_event(obs: Observation, base: float) -> Event:
    step, loss = int(obs.step), float(obs.loss)
    return Event(
        step=step, kind=Kind.LOSS_NONFINITE, level=Level.CRITICAL, signal="loss",
        message=(f"Loss is {fmt(loss)} at step {step}; the run is diverging or a batch is "
                 "corrupt: rewind to the last clean checkpoint and skip this batch."),
        values={"value": loss, "baseline": base, "ratio": math.inf},
        batch=obs.batch)


def loss_diverged_event(obs: Observation, w: Work, dl: float, log_now: float, now: float, z: float) -> Event:
    """LOSS_DIVERGED: ``dl`` the log-deviation, ``log_now`` the loss channel's log-value, ``now``
    the loss as given, ``z`` its deviation in scales."""
    shift = w.loss_shift
    base = math.exp(log_now - dl) - shift
    how = f"at {times(math.exp(dl))} its baseline" if shift == 0.0 else "far above its baseline"
    return Event(
        step=int(obs.step), kind=Kind.LOSS_DIVERGED, level=Level.WARNING, signal="loss",
        message=(f"Loss has stayed {how} ({fmt(base)} -> {fmt(now)}, "
                 f"{z:.0f} times its usual step-to-step deviation) for {w.loss_div} "
                 "steps: the run is losing what it learned, or the data changed."),
        values={"value": now, "baseline": base, "ratio": math.exp(dl), "z": z, "steps": float(w.loss_div)},
        batch=obs.batch)
