"""Eight distinct prompts shared by the real-model tests (runner and HTTP levels), and
Qwen3-Reranker's prompt as a score template (vLLM's form: the ``query`` and ``document``
roles)."""

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

QWEN3_RERANKER = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages\n"
    "<Query>: {{ messages | selectattr('role', 'eq', 'query') | map(attribute='content') "
    "| first }}\n<Document>: {{ messages | selectattr('role', 'eq', 'document') "
    "| map(attribute='content') | first }}<|im_end|>\n<|im_start|>assistant\n"
    "<think>\n\n</think>\n\n"
)
