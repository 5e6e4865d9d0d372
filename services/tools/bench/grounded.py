"""Input-grounded prompts: answers that copy from their prompt, where prompt-lookup
speculation finds its drafts (`bench spec` in process, `bench serve --prompts grounded`
through the stack). Each asks the model to repeat a function of Python's standard library,
or to rename a name in it and give the function back; the function's source is the prompt."""

from __future__ import annotations

import functools
import inspect
import json
import random
import statistics
import textwrap
from typing import Any, Callable

# Functions of the standard library of a few hundred tokens each (their source is the
# prompt's text; what the model copies back).
SOURCES: tuple[Callable[..., Any], ...] = (
    textwrap.dedent,
    textwrap.indent,
    json.dumps,
    statistics.median,
    random.Random.choices,
    inspect.cleandoc,
)


@functools.cache  # read the sources once: bench serve draws a task per prompt
def grounded_prompts() -> tuple[tuple[dict[str, str], ...], ...]:
    """Two chat prompts per source: repeat it, and rename its function in it (tuples:
    one cached copy is shared by every caller)."""
    out = []
    for fn in SOURCES:
        src = inspect.getsource(fn)
        out.append(({"role": "user", "content": f"Repeat this function exactly:\n\n{src}"},))
        first = fn.__name__
        rename = f"Rename `{first}` to `{first}_v2` in this function and write the whole"
        out.append(({"role": "user", "content": f"{rename} function:\n\n{src}"},))
    return tuple(out)
