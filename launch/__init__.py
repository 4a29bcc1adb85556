"""Process management: local clusters of stage processes, the launcher that forks them, their supervisor,
the front door and chain processes of several chains, signal handling and the shapes of a process's end."""
