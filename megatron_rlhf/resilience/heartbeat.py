"""Rank heartbeats for nvidia-resiliency-ext's ft_launcher (in-job restart). Placeholder:
beat() and close() do nothing until the ft_launcher integration lands."""


class Heartbeat:
    @classmethod
    def from_env(cls) -> "Heartbeat":
        return cls()

    def beat(self) -> None:
        pass

    def close(self) -> None:
        pass
