"""What tests/test_task_queues.py and tests/test_enqueue_unique.py run in real worker
processes: the task functions (Django Tasks in ``tasks``, Celery in ``celery_worker``), what
they do (``bodies``), the Celery app's configuration (``celery_config``), the brokers and
worker processes (``services``), and the processes that call ``enqueue_unique`` at once
(``enqueuers``). The tasks that tests/test_schedule_tasks.py schedules: ``schedule_tasks``
(Django Tasks), ``schedule_celery`` (Celery) and what they do (``schedule_bodies``).
"""
