//! [`sql_store!`](crate::sql_store): the type of a SQL store.

/// The type of a SQL store generic over its database `DB`: the connection pool ([`crate::Db`]), which is all
/// it holds, `Debug` and `Clone` whatever `DB` is (`#[derive(Clone)]` would ask for
/// `DB: Clone`, which no sqlx database is), made by `new` for the module around it (where the
/// store's `sqlite` and `postgres` openers are) and ended by `close`. Every SQL store is this
/// same type under its own name, so that each service implements its own store trait on it
/// and adds what opens it.
///
/// ```ignore
/// ecoscan_sql::sql_store! {
///     /// [`CallStore`] on the SQL database `DB`.
///     pub struct SqlCallStore<DB> { pool }
/// }
/// ```
///
/// The field is private unless given a visibility (`{ pub(super) pool }`).
#[macro_export]
macro_rules! sql_store {
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident<$db:ident> { $pool_vis:vis pool $(,)? }
    ) => {
        $(#[$attr])*
        #[derive(Debug)]
        $vis struct $name<$db: $crate::Dialect> {
            $pool_vis pool: $crate::Db<$db>,
        }

        impl<$db: $crate::Dialect> ::core::clone::Clone for $name<$db> {
            fn clone(&self) -> Self {
                Self {
                    pool: self.pool.clone(),
                }
            }
        }

        impl<$db: $crate::Dialect> $name<$db> {
            pub(super) fn new(pool: impl ::core::convert::Into<$crate::Db<$db>>) -> Self {
                Self { pool: pool.into() }
            }

            /// Closes every connection.
            pub async fn close(&self) {
                self.pool.close().await;
            }
        }
    };
}
