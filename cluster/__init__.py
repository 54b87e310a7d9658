"""Starting a pdserve service: Ray, Redis, the workers and the router (``pdserve up``, ``demo``)."""
