from django.db import models


class Counter(models.Model):
    """A named counter: the demo's and the tests' shared state to protect."""

    name = models.CharField(max_length=100, unique=True)
    value = models.IntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.name}={self.value}"
