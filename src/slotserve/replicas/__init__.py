"""Engine replicas on Ray Serve behind one OpenAI URL (``slotserve serve --replicas N``).
Ray is imported only by the modules below, never by this package's ``__init__``: the base
install runs without it."""
