"""HTTP clients of participants' control planes: the controller (`gym-proxy-ctl`) and the
rollout driver (`gym-proxy-rollouts`); they run outside gym-proxy."""
