"""``slotserve chat``: a terminal conversation with a model.

``backend.py`` gets replies (the engine in this process, or a running server over the OpenAI
API), ``session.py`` holds the conversation and its slash commands (no terminal needed),
``terminal.py`` does the I/O (prompt_toolkit input, rich output, Ctrl-C), ``command.py`` the
flags.
"""
