from django.contrib import admin
from django.urls import path

from testproject.example import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("counter/increment/", views.increment_counter, name="increment-counter"),
    path("counter/aincrement/", views.aincrement_counter, name="aincrement-counter"),
    path("counter/try-increment/", views.try_increment_counter, name="try-increment-counter"),
    path(
        "counter/increment-unlocked/",
        views.increment_counter_unlocked,
        name="increment-counter-unlocked",
    ),
    path(
        "counter/aincrement-unlocked/",
        views.aincrement_counter_unlocked,
        name="aincrement-counter-unlocked",
    ),
]
