"""What tests/test_task_queues.py runs in real worker processes: the task functions (Django
Tasks in ``tasks``, Celery in ``celery_worker``), what they do (``bodies``), the Celery app's
configuration (``celery_config``), and the brokers and worker processes (``services``).
"""
