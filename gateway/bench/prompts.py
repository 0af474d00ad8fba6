"""Prompt sets for benchmarks: input-grounded tasks (rewrite, summarize, extract, edit code),
whose answers reuse the input, and open chat, whose answers do not."""

PARAGRAPH = (
    "Speculative decoding speeds up inference of large language models by letting a small, "
    "cheap proposer guess several tokens ahead. The large model then checks all the guesses "
    "in a single forward pass and keeps the longest prefix it agrees with. Because checking "
    "several tokens costs about as much as generating one, every accepted guess is almost "
    "free. The output is exactly what the large model would have produced on its own."
)
CODE = """def moving_average(values, window):
    result = []
    for i in range(len(values)):
        start = max(0, i - window + 1)
        chunk = values[start:i + 1]
        result.append(sum(chunk) / len(chunk))
    return result
"""
BUGGY_CODE = CODE.replace("i + 1]", "i]")
# Input-grounded tasks (rewrite, summarize, extract, edit code) phrased so that a 135M model
# actually does them: its answers reuse the input, which is where prompt lookup pays.
GROUNDED = [
    "Fix the spelling mistakes in this text and return the corrected text:\n\n"
    + PARAGRAPH.replace("the ", "teh ").replace("large", "lage"),
    "Fix the grammar in this text:\n\n" + PARAGRAPH.replace("costs", "cost").replace("lets", "let"),
    f"TL;DR of the following text, using its own words:\n\n{PARAGRAPH}",
    "Extract all names and cities from the text as a list.\n\n"
    "Maria Lopez moved from Madrid to Lisbon in 2019. Her brother, Carlos Lopez, still lives in Madrid. "
    "Their friend Anna Schmidt works in Berlin, and Anna's cousin Peter Schmidt teaches in Vienna.",
    "Extract the dates and events from the text below as a bulleted list.\n\n"
    "On 12 March 2021 the company opened its first office in Lyon. On 3 June 2022 it launched its "
    "mobile app. On 18 January 2023 it hired its hundredth employee. On 9 September 2024 it opened "
    "a second office in Montreal.",
    f"Fix the bug in this code and return the corrected code:\n\n```python\n{BUGGY_CODE}```",
]
OPEN_CHAT = [
    "Write a short poem about the sea.",
    "Give me three tips for learning a new language.",
    "Why is the sky blue? Explain simply.",
    "Tell me a short story about a robot who learns to paint.",
]

PROMPT_SETS = {"grounded": GROUNDED, "chat": OPEN_CHAT}
