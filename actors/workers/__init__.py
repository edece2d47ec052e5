"""The actors of a run, one file per role (plain classes, wrapped by `ray.remote` in
actors/driver/cluster.py): rollout.py, teacher.py, learner.py (DeepSpeed), evaluation.py,
queue.py (the trajectory queue); base.py is what every worker has."""
