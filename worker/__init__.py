"""What prefill and decode workers share: the worker runtime and the router-worker messages."""
