"""What the measurements say: each knob's one-line verdict with its figure, and the recommendation.

Two options are told apart only when their spreads do not overlap (the first quartile of the faster option's stretch
rates is above the third quartile of the slower's): otherwise the verdict says they cannot be told apart, and the
advice keeps what the user has. The recommendation is the fastest option that keeps the user's result (the same
effective batch, optimizer and lr; a precision only when its val_mse after the same steps is within the tolerance)
and is told apart from the user's command; none: the user's command is the advice.
"""

from dataclasses import dataclass

from experiments.advice.trials import Measurement


def apart(a: Measurement, b: Measurement) -> bool:
    """Whether the two options' spreads (the quartiles of their stretch rates) do not overlap."""
    return a.low > b.high or a.high < b.low


def ratio(a: Measurement, b: Measurement) -> float:
    return a.median / b.median


def speed_words(a: Measurement, b: Measurement) -> str:
    """ "1.8x faster than X", "costs 1.8x X", or "cannot be told apart from X (0.97x, ranges overlap)"."""
    r = ratio(a, b)
    if not apart(a, b):
        return f"cannot be told apart from {b.option.name} ({r:.2f}x, their timings' quartiles overlap)"
    return f"{r:.2f}x as fast as {b.option.name}" if r > 1 else f"costs {1 / r:.2f}x the time of {b.option.name}"


def relative_gap(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else abs(a - b) / b


def same_result(m: Measurement, base: Measurement, tolerance: float) -> bool | None:
    """A precision's or compile's val_mse against its base's after the same optimizer steps: within `tolerance`.
    None when they did not run the same steps (no comparison)."""
    if m.metrics.get("global_step") != base.metrics.get("global_step"):
        return None
    gap = relative_gap(m.metrics.get("val_mse"), base.metrics.get("val_mse"))
    return gap is not None and gap <= tolerance


@dataclass
class Line:
    knob: str
    text: str


def knob_line(knob: str, m: Measurement, base: Measurement, setting: str, keep: str, tolerance: float) -> Line:
    """One option against the one it changes: its figure, and whether to take it."""
    if m.error:
        return Line(knob, f"{m.option.name}: not measured: {m.error}; keep {keep}")
    words = speed_words(m, base)
    extra = ""
    if m.option.knob in ("precision", "compile"):
        gap = relative_gap(m.metrics.get("val_mse"), base.metrics.get("val_mse"))
        same = same_result(m, base, tolerance)
        if gap is not None and same is not None:
            steps = m.metrics.get("global_step")
            within = "within" if same else "NOT within"
            extra = f", val MSE {within} {100 * tolerance:g}% ({100 * gap:.2g}%) after {steps} steps"
        if m.option.knob == "compile" and m.warmup_s is not None and base.warmup_s is not None:
            extra += f", warm-up {m.warmup_s:.1f} s against {base.warmup_s:.1f} s (compilation)"
    pays = apart(m, base) and ratio(m, base) > 1 and (m.option.knob not in ("precision", "compile") or
                                                    same_result(m, base, tolerance))  # fmt: skip
    advice = f"use {setting}" if pays else f"keep {keep}"
    at = "" if "B=" in m.option.name else f" at B={m.option.micro} x{m.option.accumulate}"
    return Line(knob, f"{m.option.name}{at}: {words}{extra}: {advice}")


def batch_line(sweep: list[Measurement], yours: Measurement) -> Line:
    """Throughput against the batch (one micro-step an optimizer step): where it stops gaining, where memory stops
    it, and how much faster a larger batch than the user's runs (a change of the result)."""
    timed = [m for m in sweep if m.rates]
    if not timed:
        return Line("batch", "throughput against batch: nothing measured")
    best = max(timed, key=lambda m: m.median)
    plateau = next(m for m in timed if not apart(m, best) or m is best)  # the smallest batch as fast as the best
    refused = [m for m in sweep if m.error and m.error.startswith("refused")]
    stops = (
        f"; memory refuses B={refused[0].option.micro}"
        if refused
        else f"; memory allowed every batch up to B={sweep[-1].option.micro}"
    )
    text = (
        f"throughput against batch: gains up to B={plateau.option.micro} ({plateau.median:,.0f} samples/s), "
        f"the fastest B={best.option.micro} at {ratio(best, yours):.2f}x your command{stops}"
    )
    if best.option.effective != yours.option.effective and apart(best, yours) and ratio(best, yours) > 1:
        text += (
            f" (B={best.option.micro} changes the result: another effective batch than your {yours.option.effective})"
        )
    return Line("batch", text)


def recommend(candidates: list[Measurement], yours: Measurement, bases: dict, tolerance: float) -> Measurement:
    """The fastest candidate that keeps the result and is told apart from, and faster than, the user's command;
    the user's own when none is. A precision or compile counts only where it is told apart from, and faster than, the
    option it changes (and keeps its val_mse within `tolerance`). `bases`: a precision's or compile's option name ->
    the measurement it changes."""
    keeping = []
    for m in candidates:
        if m.error or not m.rates or not m.option.keeps_result:
            continue
        base = bases.get(m.option.name)  # a precision or compile over another option: it must pay over that one
        if base is not None and (
            not same_result(m, base, tolerance) or not apart(m, base) or m.median < base.median
        ):
            continue
        if apart(m, yours) and ratio(m, yours) > 1:
            keeping.append(m)
    return max(keeping, key=lambda m: m.median, default=yours)
