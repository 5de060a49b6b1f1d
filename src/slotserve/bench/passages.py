"""Texts and code for the input-grounded workload (``datasets.edit_dataset``): the model is
asked to copy or lightly edit one of them, so most of its answer is in its prompt, which is
where prompt-lookup speculation finds its drafts. Each passage comes with a word to replace
for the edit variant."""

from __future__ import annotations

# (passage, word in it, its replacement)
PASSAGES: tuple[tuple[str, str, str], ...] = (
    (
        "The library opens at nine in the morning and closes at six in the evening. Visitors "
        "may borrow up to five books at a time for three weeks. Late returns cost ten cents a "
        "day. The reading room on the second floor is quiet at all times, and the children's "
        "corner has story hour every Saturday at eleven.",
        "nine",
        "eight",
    ),
    (
        "To make the bread, mix the flour, salt and yeast in a large bowl. Add warm water and "
        "stir until a soft dough forms. Knead it for ten minutes, then leave it covered in a "
        "warm place for an hour. Shape the loaf, let it rise again, and bake it for thirty "
        "minutes until the crust is golden.",
        "thirty",
        "forty",
    ),
    (
        "Our team meets every Monday to plan the week. Each person shares what they finished, "
        "what they will work on next, and anything that blocks them. Notes go into the shared "
        "folder the same day, and decisions are marked in bold so that anyone who missed the "
        "meeting can find them quickly.",
        "Monday",
        "Tuesday",
    ),
    (
        "def moving_average(values, window):\n"
        '    """Return the moving averages of values over a window."""\n'
        "    if window <= 0:\n"
        '        raise ValueError("window must be positive")\n'
        "    result = []\n"
        "    total = 0.0\n"
        "    for index, value in enumerate(values):\n"
        "        total += value\n"
        "        if index >= window:\n"
        "            total -= values[index - window]\n"
        "        if index >= window - 1:\n"
        "            result.append(total / window)\n"
        "    return result\n",
        "window",
        "size",
    ),
    (
        "class Inventory:\n"
        "    def __init__(self):\n"
        "        self.items = {}\n"
        "\n"
        "    def add(self, name, count=1):\n"
        "        self.items[name] = self.items.get(name, 0) + count\n"
        "\n"
        "    def remove(self, name, count=1):\n"
        "        if self.items.get(name, 0) < count:\n"
        '            raise KeyError(f"not enough {name}")\n'
        "        self.items[name] -= count\n"
        "\n"
        "    def total(self):\n"
        "        return sum(self.items.values())\n",
        "items",
        "stock",
    ),
    (
        "function formatPrice(amount, currency) {\n"
        "  const rounded = Math.round(amount * 100) / 100;\n"
        "  if (currency === 'EUR') {\n"
        "    return rounded.toFixed(2) + ' EUR';\n"
        "  }\n"
        "  return '$' + rounded.toFixed(2);\n"
        "}\n"
        "\n"
        "console.log(formatPrice(12.5, 'USD'));\n"
        "console.log(formatPrice(7.125, 'EUR'));\n",
        "rounded",
        "value",
    ),
)


def edit_prompt(index: int) -> str:
    """The ``index``-th task: passages in turn, copy first, then the edit of each."""
    passage, word, replacement = PASSAGES[index % len(PASSAGES)]
    kind = "code" if "\n" in passage else "text"
    if (index // len(PASSAGES)) % 2 == 0:
        return f"Repeat this {kind} exactly, with no comment:\n\n{passage}"
    return (
        f"Copy this {kind}, replacing every {word!r} with {replacement!r}, and write nothing "
        f"else:\n\n{passage}"
    )
