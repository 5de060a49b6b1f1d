"""Eight distinct prompts shared by the real-model tests (runner and HTTP levels)."""

PROMPTS = [
    "The history of the Roman empire",
    "def fibonacci(n):",
    "Ingredients for a chocolate cake:",
    "Le président de la République",
    "Once upon a time, in a land far away,",
    "The three laws of thermodynamics are",
    "SELECT name, age FROM users WHERE",
    "My favourite season is autumn because",
]
