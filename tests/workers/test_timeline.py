"""The demo's timeline plot cannot be misread: no step is drawn in the colour or the style of "waiting
for rows" (``workers.timeline``). Before, the steps cycled through matplotlib's tab10, whose eighth
colour is a grey, and waiting was a grey line: every tenth step looked like waiting. No matplotlib
needed: the palette is plain hex strings.
"""

from __future__ import annotations

import colorsys

from workers.timeline import STEP_COLORS, WAIT_COLOR, WAIT_STYLE, step_color


def _rgb(hex_color: str) -> tuple[float, float, float]:
    value = hex_color.lstrip("#")
    r, g, b = (int(value[i : i + 2], 16) / 255 for i in (0, 2, 4))
    return r, g, b


def test_no_step_is_drawn_like_waiting() -> None:
    wait = _rgb(WAIT_COLOR)
    colors = {step_color(step) for step in range(100)}
    assert colors == set(STEP_COLORS) and len(STEP_COLORS) >= 8  # neighbouring steps stay apart
    for color in colors:
        rgb = _rgb(color)
        _, lightness, saturation = colorsys.rgb_to_hls(*rgb)
        # Neither near the waiting colour nor a grey (a grey next to a black line reads as waiting too).
        assert sum((a - b) ** 2 for a, b in zip(rgb, wait, strict=True)) ** 0.5 > 0.4, color
        assert saturation > 0.25 and lightness > 0.2, color
    assert WAIT_STYLE["color"] == WAIT_COLOR and WAIT_STYLE["linestyle"] not in ("-", "solid")
