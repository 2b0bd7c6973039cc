"""Load: what each worker carries (`load`), the rebalance that follows it (`balancer`, its
policy `rebalance`) and the worker count that follows demand (`autoscale`)."""
