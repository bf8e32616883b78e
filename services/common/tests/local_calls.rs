//! In-process calls ([`ecoscan_common::local`]): a client of an offered address reaches the
//! server through memory, never a socket, while the server's TCP port keeps serving everyone
//! else; a stopped server refuses, and an address nobody offered is dialled over TCP. Whether a
//! call crossed a socket is read from the kernel's own table of TCP connections.

use std::{net::SocketAddr, time::Duration};

use ecoscan_common::{
    balance::Balancing,
    client::{TracedChannel, channel_with},
    local,
    testing::{Spawned, established_tcp, spawn},
};
use tonic::{Code, service::Routes};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

async fn server(offered: bool) -> Spawned {
    server_of(offered, Routes::default).await
}

async fn server_of(offered: bool, routes: fn() -> Routes) -> Spawned {
    let spawned = spawn(move |listener, shutdown| async move {
        if offered {
            local::offer(listener.local_addr()?);
        }
        ecoscan_common::server::serve(routes(), &[], listener, shutdown).await
    })
    .await;
    // The server task offers before serving; wait until it has (the test's own ordering, not a
    // timing assumption about the server).
    if offered {
        for _ in 0..500 {
            if local::is_offered(spawned.addr) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(local::is_offered(spawned.addr), "the server never offered");
    }
    spawned
}

fn client(addr: SocketAddr) -> HealthClient<TracedChannel> {
    let channel = channel_with(
        &format!("http://{addr}"),
        None,
        &Balancing::from_env().unwrap(),
    )
    .unwrap();
    HealthClient::new(channel)
}

async fn check(client: &mut HealthClient<TracedChannel>) -> Result<i32, tonic::Status> {
    client
        .check(HealthCheckRequest::default())
        .await
        .map(|r| r.into_inner().status)
}

#[tokio::test]
async fn an_offered_server_is_called_in_memory_and_still_serves_tcp() {
    let server = server(true).await;
    let mut inside = client(server.addr);
    for _ in 0..3 {
        assert_eq!(
            check(&mut inside).await.unwrap(),
            ServingStatus::Serving as i32
        );
    }
    assert_eq!(
        established_tcp(server.addr.port()),
        0,
        "an in-process call opened a TCP connection"
    );

    // Outside callers (grpcurl, probes, other processes) still reach the TCP port.
    let tcp = tonic::transport::Endpoint::from_shared(server.uri())
        .unwrap()
        .connect()
        .await
        .expect("the TCP port accepts connections");
    let status = HealthClient::new(tcp)
        .check(HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(status, ServingStatus::Serving as i32);
    assert!(
        established_tcp(server.addr.port()) >= 2,
        "the outside call did not cross TCP"
    );
    // `/metrics` over plain HTTP/1.1 on the same port (it panics unless 200).
    ecoscan_common::testing::scrape(server.addr).await;

    // A stopped server withdraws its address: the in-process client is refused, not hung.
    let addr = server.addr;
    server.stop().await.unwrap();
    assert!(!local::is_offered(addr));
    let err = check(&mut inside).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
}

#[tokio::test]
async fn a_server_nobody_offered_is_called_over_tcp() {
    let server = server(false).await;
    assert!(!local::is_offered(server.addr));
    let mut outside = client(server.addr);
    assert_eq!(
        check(&mut outside).await.unwrap(),
        ServingStatus::Serving as i32
    );
    assert!(
        established_tcp(server.addr.port()) >= 2,
        "a call to an address nobody offered did not cross TCP"
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_bidirectional_stream_crosses_the_pipe() {
    // Reflection is a bidirectional stream: fifty requests in, fifty descriptor sets out, all
    // in memory.
    let server = server(true).await;
    let channel = channel_with(&server.uri(), None, &Balancing::from_env().unwrap()).unwrap();
    let mut reflection =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(channel)
            .max_decoding_message_size(64 * 1024 * 1024);
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_request::MessageRequest,
        server_reflection_response::MessageResponse,
    };
    let requests = (0..50).map(|_| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::FileContainingSymbol(
            "grpc.health.v1.Health".into(),
        )),
    });
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter(requests))
        .await
        .unwrap()
        .into_inner();
    let mut bytes = 0;
    let mut count = 0;
    while let Some(answer) = answers.message().await.unwrap() {
        let Some(MessageResponse::FileDescriptorResponse(files)) = answer.message_response else {
            panic!("not a file descriptor answer: {answer:?}");
        };
        bytes += files
            .file_descriptor_proto
            .iter()
            .map(Vec::len)
            .sum::<usize>();
        count += 1;
    }
    assert_eq!(count, 50);
    assert!(bytes > 0);
    assert_eq!(established_tcp(server.addr.port()), 0);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn an_in_process_call_keeps_its_deadline_and_a_stopping_server_waits_for_its_calls() {
    use tower::{Service as _, ServiceExt as _};
    // A method that answers after 2 s: a call with a 100 ms deadline is answered
    // `DEADLINE_EXCEEDED` as over HTTP/2 (the server's deadline layer), one without finishes even while the server is
    // asked to stop, as an open stream of a draining connection does.
    static STARTED: std::sync::LazyLock<tokio::sync::Notify> =
        std::sync::LazyLock::new(tokio::sync::Notify::new);
    async fn answer_in_2s() -> ([(&'static str, &'static str); 1], &'static str) {
        tokio::time::sleep(Duration::from_secs(2)).await;
        ([("grpc-status", "0")], "")
    }
    fn slow() -> Routes {
        Routes::from(
            axum::Router::new()
                .route("/test.Slow/Cut", axum::routing::post(answer_in_2s))
                .route(
                    "/test.Slow/Call",
                    axum::routing::post(|| async {
                        STARTED.notify_one();
                        answer_in_2s().await
                    }),
                ),
        )
    }
    let server = server_of(true, slow).await;
    let channel = channel_with(&server.uri(), None, &Balancing::from_env().unwrap()).unwrap();
    let call = |path: &'static str, deadline: Option<&'static str>| {
        let mut channel = channel.clone();
        async move {
            let mut req = http::Request::post(path)
                .header("content-type", "application/grpc")
                .body(tonic::body::Body::empty())
                .unwrap();
            if let Some(d) = deadline {
                req.headers_mut()
                    .insert("grpc-timeout", http::HeaderValue::from_static(d));
            }
            channel.ready().await?.call(req).await
        }
    };
    let cut = call("/test.Slow/Cut", Some("100m"))
        .await
        .expect("the server answers a deadline that ran out");
    let status = tonic::Status::from_header_map(cut.headers()).expect("a grpc-status");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");

    let unbounded = tokio::spawn(call("/test.Slow/Call", None));
    // Once the call is in the server's hands, stop the server: the call still gets its answer.
    STARTED.notified().await;
    let addr = server.addr;
    server.stop().await.unwrap();
    // The test's runtime has one thread: the call ended in the same poll that let the server stop.
    assert!(
        unbounded.is_finished(),
        "the server stopped before its call in flight ended"
    );
    let answer = unbounded.await.unwrap().expect("a call in flight finishes");
    assert_eq!(answer.status(), http::StatusCode::OK);
    assert!(!local::is_offered(addr));
    assert_eq!(established_tcp(addr.port()), 0);
}

#[tokio::test]
async fn a_request_over_the_size_limit_is_refused_in_plain_words() {
    // Health's limit is tonic's default (4 MiB): a 5 MiB service name is over it, over TCP and
    // in memory alike, and the answer is not tonic's own "decoded message length too large".
    for offered in [false, true] {
        let server = server(offered).await;
        let mut health = client(server.addr);
        let err = health
            .check(HealthCheckRequest {
                service: "x".repeat(5 * 1024 * 1024),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
        assert!(
            err.message()
                .starts_with("the request is 5.0 MiB, more than the 4 MiB"),
            "{err:?}"
        );
        assert!(!err.message().contains("decoded message"), "{err:?}");
        // The reason travels as google.rpc details (grpc-status-details-bin).
        use tonic_types::StatusExt as _;
        let details = err.get_error_details();
        let info = details.error_info().expect("an ErrorInfo");
        assert_eq!(info.reason, "MESSAGE_TOO_LARGE");
        assert_eq!(info.domain, "ecoscan");
        assert_eq!(info.metadata["limit"], "4194304");
        server.stop().await.unwrap();
    }
}
