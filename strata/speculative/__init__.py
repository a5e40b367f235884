"""MTP speculative decoding: drafting with the model's own MTP head, verification, statistics."""
