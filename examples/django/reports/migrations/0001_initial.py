from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies = ()

    operations = (
        migrations.CreateModel(
            name="Tick",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("slot_ms", models.BigIntegerField()),
                ("reason", models.CharField(max_length=16)),
                ("instance_id", models.CharField(max_length=200)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
            ],
        ),
    )
