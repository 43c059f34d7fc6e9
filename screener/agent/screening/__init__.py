"""The screening window (window: taint, screen with a time cap, yield to jobs, untaint)
and the worker process the screens run in (worker; `python -m
screener.agent.screening.window worker`, see __main__)."""
