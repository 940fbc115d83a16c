"""Long-form speech: a text of any length -> one recording."""
