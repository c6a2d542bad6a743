"""RL math: correction operators, advantages and policy losses (pure functions); math-verify rewards in a process pool."""
