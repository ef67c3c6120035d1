"""The native-async test suite: ``AsyncStore`` on aiosqlite, asyncpg and psycopg_async."""
