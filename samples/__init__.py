"""Runnable sample models for blockdiff and candidates with planted bugs."""
