"""What travels between the roles: student weights (weights.py), a part cut into the learner
ranks' pieces and its report (delivery.py), row ranges and shards (shards.py), and the payload
bytes each actor receives and sends (iostats.py)."""
