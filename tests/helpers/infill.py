"""A fill-in-the-middle request's prefix, suffix, chunks and timings, shared by the infill tests."""

from __future__ import annotations


PREFIX = "import math\n\n\ndef circle_area(radius):\n    "


SUFFIX = "\n\n\ndef main():\n    print(circle_area(2.0))\n"


CHUNKS = (("geometry/shapes.py", "class Circle:\n    def __init__(self, r):\n        self.r = r\n"),)


TIMINGS = ["timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms", "timings/prompt_per_second",
           "timings/predicted_n", "timings/predicted_ms", "timings/predicted_per_token_ms",
           "timings/predicted_per_second"]
