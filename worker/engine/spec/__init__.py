"""Speculative decoding: proposers guess a request's next tokens, ``rejection`` keeps the
ones the target model agrees with, so a step can emit several tokens while every token is
still drawn from the target model's own distribution.

``proposer`` (the contract every proposer keeps), ``ngram`` (prompt lookup: torch-free),
``rejection`` (verification of the guesses against the target's logits: torch).
"""
