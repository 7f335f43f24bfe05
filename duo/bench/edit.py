"""`duo bench --prompts edit`: prompts that give code and ask to change it, so that most of the answer is already in
the prompt (the regime of context lookup, duo.lookup, and of llama.cpp's ngram-* speculative modes)."""

from __future__ import annotations

INVENTORY = '''def summarize_inventory(items):
    totals = {}
    for item in items:
        name = item["name"]
        quantity = item["quantity"]
        price = item["price"]
        if name not in totals:
            totals[name] = {"quantity": 0, "value": 0.0}
        totals[name]["quantity"] += quantity
        totals[name]["value"] += quantity * price
    result = []
    for name in sorted(totals):
        entry = totals[name]
        result.append((name, entry["quantity"], round(entry["value"], 2)))
    return result
'''

PARSER = '''def parse_config(lines):
    config = {}
    section = "default"
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            config.setdefault(section, {})
            continue
        key, value = line.split("=", 1)
        config.setdefault(section, {})[key.strip()] = value.strip()
    return config
'''

MEDIAN = '''def moving_median(values, window):
    result = []
    for i in range(len(values)):
        start = i - window + 1
        if start < 0:
            start = 0
        chunk = sorted(values[start:i + 1])
        middle = len(chunk) // 2
        if len(chunk) % 2 == 1:
            result.append(chunk[middle])
        else:
            result.append((chunk[middle - 1] + chunk[middle]) / 2)
    return result
'''

PROMPTS = [
    f"Rename the function to `inventory_summary` and the variable `totals` to `by_name`. Return the whole "
    f"function.\n\n```python\n{INVENTORY}```",
    f"Add type hints to this function, changing nothing else. Return the whole function.\n\n```python\n{PARSER}```",
    f"Add a docstring to this function, changing nothing else. Return the whole function.\n\n```python\n{MEDIAN}```",
    f"Convert the second loop into a list comprehension. Return the whole function.\n\n```python\n{INVENTORY}```",
    f"Fix the bug: a line without '=' makes this crash; skip such lines instead. Return the whole "
    f"function.\n\n```python\n{PARSER}```",
]
