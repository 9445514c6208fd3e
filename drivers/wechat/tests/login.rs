//! The QR login against the fake iLink server: every status on the way, the verification
//! code, the redirect, and what ends up in the state directory.

use std::time::Duration;

use channeld_tests::fakes::wechat::{FakeIlink, FakeOptions, LoginStep};
use channeld_wechat::client::IlinkClient;
use channeld_wechat::config::LoginConfig;
use channeld_wechat::login::{LoginError, LoginOutcome, login};
use channeld_wechat::state::StateDir;

fn quick() -> FakeOptions {
    FakeOptions { hold: Duration::from_millis(200), ..FakeOptions::default() }
}

fn client() -> IlinkClient {
    IlinkClient::new(
        channeld_wechat::client::http_client().unwrap(),
        "channeld-wechat-test/1",
        None,
    )
}

fn config(fake: &FakeIlink, dir: &std::path::Path) -> LoginConfig {
    LoginConfig { base_url: fake.base_url(), state_dir: dir.to_owned(), route_tag: None }
}

#[tokio::test]
async fn a_login_through_a_code_and_a_redirect_stores_a_usable_token() {
    let fake = FakeIlink::start_with(quick()).await;
    let redirect = format!("localhost:{}", fake.port());
    fake.script_login(vec![
        LoginStep::Scaned,
        LoginStep::NeedVerifyCode { code: "4321".into() },
        LoginStep::ScanedButRedirect { host: redirect.clone() },
        LoginStep::Confirmed {
            bot_token: "confirmed-token".into(),
            bot_id: "bot-1@im.bot".into(),
            user_id: "owner@im.wechat".into(),
            base_url: None,
        },
    ]);
    let dir = tempfile::tempdir().unwrap();
    let mut out = Vec::new();
    let mut codes = vec!["0000".to_owned(), "4321".to_owned()].into_iter();
    let mut prompts = Vec::new();
    let outcome = login(&client(), &config(&fake, dir.path()), &mut out, &mut |prompt| {
        prompts.push(prompt.to_owned());
        Ok(codes.next())
    })
    .await
    .unwrap();

    let LoginOutcome::LoggedIn(stored) = outcome else { panic!("not logged in") };
    assert_eq!(stored.bot_id, "bot-1@im.bot");
    assert_eq!(stored.user_id.as_deref(), Some("owner@im.wechat"));
    assert_eq!(stored.base_url.as_deref(), Some(fake.base_url().as_str()));
    let on_disk = StateDir::open(dir.path()).unwrap().load_login().unwrap().unwrap();
    assert_eq!(on_disk.bot_token, "confirmed-token");
    assert_eq!(prompts.len(), 2);
    assert!(prompts[1].contains("did not match"), "{prompts:?}");

    let printed = String::from_utf8(out).unwrap();
    assert!(printed.contains("https://liteapp.weixin.qq.com/q/fake"), "{printed}");
    assert!(printed.contains("bot-1@im.bot"));
    assert!(!printed.contains("confirmed-token"), "the token is never printed");

    let records = fake.records();
    let polls = records.of("get_qrcode_status");
    let last = polls.last().unwrap();
    assert_eq!(last.host.as_deref(), Some(redirect.as_str()), "polling followed the redirect");
    assert!(polls.iter().any(|p| p.query.get("verify_code").map(String::as_str) == Some("4321")));
    fake.assert_no_violations();
}

#[tokio::test]
async fn an_expired_code_is_replaced_and_earlier_tokens_are_listed() {
    let fake = FakeIlink::start_with(quick()).await;
    let dir = tempfile::tempdir().unwrap();
    let confirmed = |token: &str| LoginStep::Confirmed {
        bot_token: token.into(),
        bot_id: "b@im.bot".into(),
        user_id: "u@im.wechat".into(),
        base_url: None,
    };
    fake.script_login(vec![confirmed("first")]);
    let mut out = Vec::new();
    login(&client(), &config(&fake, dir.path()), &mut out, &mut |_| Ok(None)).await.unwrap();

    fake.script_login(vec![LoginStep::Expired, confirmed("second")]);
    let outcome =
        login(&client(), &config(&fake, dir.path()), &mut out, &mut |_| Ok(None)).await.unwrap();
    let LoginOutcome::LoggedIn(stored) = outcome else { panic!("not logged in") };
    assert_eq!(stored.bot_token, "second");
    assert_eq!(stored.previous_tokens, ["first"]);
    let lists = fake.records().local_token_lists;
    assert_eq!(lists, [vec![], vec!["first".to_owned()], vec!["first".to_owned()]]);
    fake.assert_no_violations();
}

#[tokio::test]
async fn already_bound_keeps_a_stored_login_and_fails_without_one() {
    let fake = FakeIlink::start_with(quick()).await;
    let dir = tempfile::tempdir().unwrap();
    fake.script_login(vec![LoginStep::BindedRedirect]);
    let err = login(&client(), &config(&fake, dir.path()), &mut Vec::new(), &mut |_| Ok(None))
        .await
        .unwrap_err();
    assert!(matches!(err, LoginError::BoundWithoutLogin(_)), "{err}");

    fake.script_login(vec![LoginStep::Confirmed {
        bot_token: "kept".into(),
        bot_id: "b".into(),
        user_id: "u".into(),
        base_url: None,
    }]);
    login(&client(), &config(&fake, dir.path()), &mut Vec::new(), &mut |_| Ok(None)).await.unwrap();
    fake.script_login(vec![LoginStep::BindedRedirect]);
    let outcome = login(&client(), &config(&fake, dir.path()), &mut Vec::new(), &mut |_| Ok(None))
        .await
        .unwrap();
    assert!(matches!(outcome, LoginOutcome::AlreadyBound(stored) if stored.bot_token == "kept"));
}

#[tokio::test]
async fn a_missing_verification_code_ends_the_login() {
    let fake = FakeIlink::start_with(quick()).await;
    let dir = tempfile::tempdir().unwrap();
    fake.script_login(vec![LoginStep::NeedVerifyCode { code: "1".into() }]);
    let err = login(&client(), &config(&fake, dir.path()), &mut Vec::new(), &mut |_| Ok(None))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no verification code"), "{err}");
    assert!(StateDir::open(dir.path()).unwrap().load_login().unwrap().is_none());
}
