"""How `strata tui` draws numbers from `GET /strata/slots`: text bars, table cells and the status line (rich Text)."""

from __future__ import annotations

from typing import Any

from rich.text import Text

# (name, width in cells); fixed widths keep the table still while rows change state.
SLOT_COLUMNS = (("slot", 4), ("state", 8), ("request", 18), ("read", 23), ("generated", 11), ("tok/s", 7),
                ("give-ways", 9), ("accept", 6))
STATE_STYLES = {"idle": "dim", "waiting": "yellow", "reading": "cyan", "decoding": "bold green"}
BAR_WIDTH = 12


def bar(done: float, total: float, width: int = BAR_WIDTH, style: str = "green") -> Text:
    """A bar of `width` cells filled in proportion done/total; half cells make it move smoothly."""
    frac = min(max(done / total, 0.0), 1.0) if total > 0 else 0.0
    halves = round(frac * width * 2)
    full, half = divmod(halves, 2)
    text = Text()
    text.append("━" * full, style=style)
    if half:
        text.append("╸", style=style)
    text.append("━" * (width - full - half), style="grey37")
    return text


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def short_id(request_id: str | None, keep: int = 18) -> str:
    if not request_id:
        return ""
    return request_id if len(request_id) <= keep else request_id[:keep - 1] + "…"


def slot_cells(slot: dict[str, Any]) -> tuple[Text | str, ...]:
    """One table row for one slot, in SLOT_COLUMNS order."""
    state = str(slot.get("state", "?"))
    cells: list[Text | str] = [str(slot.get("id", "?")), Text(state, style=STATE_STYLES.get(state, ""))]
    if state == "idle":
        return (*cells, *[""] * (len(SLOT_COLUMNS) - len(cells)))
    read, prompt = int(slot.get("prompt_read") or 0), int(slot.get("prompt_tokens") or 0)
    read_cell = bar(read, prompt, style="cyan" if read < prompt else "green")
    read_cell.append(f" {read}/{prompt}")
    acceptance = slot.get("acceptance")
    cells += [
        short_id(slot.get("request_id")),
        read_cell,
        f"{slot.get('generated', 0)}/{slot.get('max_tokens', 0)}",
        _num(slot.get("tokens_per_s")),
        str(slot.get("give_ways", 0)),
        "-" if acceptance is None else f"{acceptance:.0%}",
    ]
    return tuple(cells)


def status_line(doc: dict[str, Any]) -> Text:
    """Model, slots, queue, KV use as a bar, give-ways, preemptions, finished requests, uptime."""
    t = doc.get("totals") or {}
    used, total = int(t.get("kv_blocks_used") or 0), int(t.get("kv_blocks_total") or 0)
    busy = sum(1 for s in doc.get("slots") or () if s.get("state") != "idle")
    kv_style = "red" if total and used / total > 0.9 else "yellow" if total and used / total > 0.7 else "green"
    line = Text.assemble(
        (str(doc.get("model", "?")), "bold"),
        f"  slots {busy}/{t.get('parallel', len(doc.get('slots') or ()))}",
        "  queue ", (str(t.get("queue", 0)), "bold yellow" if t.get("queue") else ""),
        "  KV ",
    )
    line.append_text(bar(used, total, style=kv_style))
    pct = f" {used / total:.0%}" if total else ""
    line.append(f" {used}/{total}{pct}")
    line.append(f"  give-ways {t.get('give_ways', 0)}  preemptions {t.get('preemptions', 0)}"
                f"  done {t.get('requests_finished', 0)}  up {duration(float(t.get('uptime_s') or 0))}")
    return line


def zero_based(samples: list[float], window: int) -> list[float]:
    """`samples` left-padded with zeros to `window`, so that a sparkline's scale starts at 0 and its
    newest sample sits at the right edge."""
    samples = samples[-window:]
    return [0.0] * (window - len(samples)) + samples


def rate_label(name: str, samples: list[float], unit: str, digits: int = 1) -> str:
    if not samples:
        return f"{name}: -"
    return f"{name}: {samples[-1]:.{digits}f} {unit} (max {max(samples):.{digits}f})"
