"""Logits processing and sampling."""
